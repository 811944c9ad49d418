#!/usr/bin/env bash
# Creates .venv, installs the project (editable) and its test and docs tools, then has
# cluster_serving.jvm fetch from Maven Central the Flink Kafka connector and the Apache Kafka
# broker's jars and compile the small Java helper jar, into the per-user cache. Safe to re-run:
# each step is skipped when its output is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv
log() { echo "[setup] $*"; }

# Runs a step's command with its output shown only when it fails: pip (setuptools' build warnings)
# and Maven (colour resets) print even with -q, and a successful step is its one [setup] line.
quietly() {
  local out
  out=$(mktemp)
  if ! "$@" >"$out" 2>&1; then
    cat "$out" >&2
    rm -f "$out"
    echo "[setup] error: $(basename "$1") ${*:2} failed (its output is above)" >&2
    exit 1
  fi
  rm -f "$out"
}

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "[setup] error: '$1' not found; $2" >&2; exit 1; }
}
need "$PYTHON" "Python >= 3.11 is required"
need java "a Java 17+ runtime is required by Flink and the local Kafka broker"
need javac "a JDK 17+ (javac) is required to compile the helper jar"
need mvn "Apache Maven is required to fetch the Kafka connector and broker jars from Maven Central"
java_major=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/ *java.specification.version = //p')
[ "${java_major%%.*}" -ge 17 ] 2>/dev/null \
  || { echo "[setup] error: Java $java_major found; Kafka 4 needs Java 17 or newer" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp=$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  log "installing the project and its dependencies into .venv (first run: ~2 minutes)"
  quietly "$VENV/bin/pip" install -q --upgrade pip
  quietly "$VENV/bin/pip" install -q -e ".[test]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

# The peers' own libraries, for the tests that produce requests as their users do
# (tests/peer_producers.py): MLServer pins protobuf and grpcio versions that Flink's apache-beam
# cannot share, so they live in a venv of their own. Made for `./run.sh test` only.
PEERS=$ROOT/.venv-peers
if [ "${1:-}" = "--peers" ] && [ ! -f "$PEERS/.installed-mlserver-1.7.1" ]; then
  log "installing MLServer 1.7.1 into .venv-peers (the peer-producer tests)"
  rm -rf "$PEERS"
  "$PYTHON" -m venv "$PEERS"
  quietly "$PEERS/bin/pip" install -q "mlserver==1.7.1" "kafka-python>=2.0.2"
  touch "$PEERS/.installed-mlserver-1.7.1"
fi

log "the jars beyond PyPI (made once into the per-user cache)"
"$VENV/bin/python" -m cluster_serving.jvm | sed "s/^/[setup]   /"
