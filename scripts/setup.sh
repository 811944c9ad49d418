#!/usr/bin/env bash
# Creates .venv, installs the project, fetches from Maven Central the Flink Kafka connector and the
# Apache Kafka broker's jars, and compiles the small Java helper jar. Safe to re-run: each step is
# skipped when its output is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv
JARS=$ROOT/build/jars
KAFKA_LIBS=$ROOT/build/kafka/libs
# Flink's official Kafka connector for Flink 2.2, as the single "SQL" jar: it carries kafka-clients
# 4.2.0 shaded, which is the class path PyFlink's own Kafka wrappers name.
CONNECTOR=org.apache.flink:flink-sql-connector-kafka:5.0.0-2.2
BROKER_POM=scripts/maven/kafka-broker.pom.xml

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

maven() { quietly mvn -q -B "$@"; }

need() {
  command -v "$1" >/dev/null 2>&1 || { echo "[setup] error: '$1' not found; $2" >&2; exit 1; }
}
need "$PYTHON" "Python >= 3.11 is required"
need java "a Java 17+ runtime is required by Flink and the local Kafka broker"
need javac "a JDK 17+ (javac) is required to build build/jars/cluster-serving-flink.jar"
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
  # A plain path entry to the checkout (pyproject.toml's package-dir), so that packages added
  # later import without a reinstall.
  quietly "$VENV/bin/pip" install -q -e ".[test]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi

mkdir -p "$JARS"
if [ ! -f "$JARS/flink-sql-connector-kafka.jar" ]; then
  log "fetching the Flink Kafka connector ($CONNECTOR) from Maven Central"
  maven dependency:copy -Dartifact="$CONNECTOR" -DoutputDirectory="$JARS" -Dmdep.stripVersion=true
fi

kafka_stamp=$ROOT/build/kafka/.fetched-$(sha1sum "$BROKER_POM" | cut -c1-12)
if [ ! -f "$kafka_stamp" ]; then
  log "fetching the Apache Kafka broker's jars ($BROKER_POM) from Maven Central"
  rm -rf "$KAFKA_LIBS" "$ROOT"/build/kafka/.fetched-*
  maven -f "$BROKER_POM" dependency:copy-dependencies -DoutputDirectory="$KAFKA_LIBS" -DincludeScope=runtime
  touch "$kafka_stamp"
fi

helper=$JARS/cluster-serving-flink.jar
if [ ! -f "$helper" ] || [ -n "$(find job/java "$JARS/flink-sql-connector-kafka.jar" -newer "$helper")" ]; then
  log "compiling $helper"
  pyflink=$("$VENV/bin/python" -c 'import os, pyflink; print(os.path.dirname(pyflink.__file__))')
  classes=$(mktemp -d)
  quietly javac -nowarn --release 11 -d "$classes" \
    -cp "$pyflink/lib/*:$JARS/flink-sql-connector-kafka.jar" job/java/*.java
  quietly jar cf "$helper" -C "$classes" .
  rm -rf "$classes"
fi
log "ready: $VENV, jars in $JARS, Kafka broker in $KAFKA_LIBS"
