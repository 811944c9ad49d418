#!/usr/bin/env bash
# Creates .venv, installs the project, fetches the Kafka connector jars from PyPI and compiles the
# small Java helper jar. Safe to re-run: each step is skipped when its output is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv
JARS=$ROOT/build/jars
# The only Flink 2.0 Kafka connector jar on PyPI: an Apache-2.0 redistribution. Installing it would
# also drop Flink 2.0.0 core jars into the venv, so only two jars are taken out of the wheel.
CONNECTOR_WHEEL="shigawire-apache-flink-libraries==2.0.0.post1"

log() { echo "[setup] $*"; }

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "[setup] error: '$1' not found; $2" >&2; exit 1; }
}
need "$PYTHON" "Python >= 3.11 is required"
need java "a Java 11+ runtime (JDK 17 recommended) is required by Flink"
need javac "a JDK (javac) is required to build build/jars/cluster-serving-flink.jar"

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp=$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  log "installing the project and its dependencies into .venv (first run: ~2 minutes)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  # compat mode: a plain path entry, so packages added later import without a reinstall
  "$VENV/bin/pip" install -q -e ".[test]" --config-settings editable_mode=compat
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

mkdir -p "$JARS"
if [ ! -f "$JARS/flink-connector-kafka.jar" ] || [ ! -f "$JARS/kafka-clients.jar" ]; then
  log "fetching the Kafka connector jars ($CONNECTOR_WHEEL)"
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps -d "$tmp" "$CONNECTOR_WHEEL"
  "$VENV/bin/python" - "$tmp" "$JARS" <<'PY'
import glob, sys, zipfile
wheel, = glob.glob(f"{sys.argv[1]}/*.whl")
with zipfile.ZipFile(wheel) as z:
    for name in ("flink-connector-kafka.jar", "kafka-clients.jar"):
        with open(f"{sys.argv[2]}/{name}", "wb") as out:
            out.write(z.read(f"pyflink/lib/{name}"))
PY
  rm -rf "$tmp"
fi

helper=$JARS/cluster-serving-flink.jar
if [ ! -f "$helper" ] || [ -n "$(find connectors/java -newer "$helper" -name '*.java')" ]; then
  log "compiling $helper"
  pyflink=$("$VENV/bin/python" -c 'import os, pyflink; print(os.path.dirname(pyflink.__file__))')
  classes=$(mktemp -d)
  javac -nowarn --release 11 -d "$classes" \
    -cp "$pyflink/lib/*:$JARS/flink-connector-kafka.jar:$JARS/kafka-clients.jar" connectors/java/*.java
  (cd "$classes" && jar cf "$helper" .)
  rm -rf "$classes"
fi
log "ready: $VENV, jars in $JARS"
