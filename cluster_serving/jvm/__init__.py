"""The Java side: the JDK that Flink and the local broker run on, and the jars PyPI does not carry
(Flink's Kafka connector and the Apache Kafka broker from Maven Central, and the helper jar
compiled from `java/`). The jars are made on first use into a per-user cache,
`$CLUSTER_SERVING_CACHE`, else `$XDG_CACHE_HOME/cluster-serving`, else `~/.cache/cluster-serving`,
named by version so that several installs share them. An image or a cluster without Maven sets
`$CLUSTER_SERVING_JARS` to a folder holding both Flink jars, built beforehand under the names
below (docker/flink/Dockerfile does).

`python -m cluster_serving.jvm` makes them all and prints where they are.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cluster_serving.config import ConfigError, FlinkConfig

# Flink's official Kafka connector for Flink 2.2, as the single "SQL" jar: it carries kafka-clients
# 4.2.0 shaded, which is the class path PyFlink's own Kafka wrappers name.
CONNECTOR = "org.apache.flink:flink-sql-connector-kafka:5.0.0-2.2"
HERE = Path(__file__).resolve().parent
BROKER_POM = HERE / "kafka-broker.pom.xml"
JAVA_SOURCES = HERE / "java"
PREBUILT_ENV = "CLUSTER_SERVING_JARS"
CONNECTOR_JAR = "flink-sql-connector-kafka.jar"
HELPER_JAR = "cluster-serving-flink.jar"


def cache_dir() -> Path:
    explicit = os.environ.get("CLUSTER_SERVING_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cluster-serving"


def find_java() -> str:
    """The java that PyFlink also launches: $JAVA_HOME/bin/java when JAVA_HOME is set, else the
    first on PATH. The broker and the embedded Flink both need it, so callers check it first."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on PATH"
        raise ConfigError(f"java not found ({where}); install a Java 17+ runtime (e.g. openjdk-17-jre) or set JAVA_HOME")
    return java


def pipeline_jars(flink: FlinkConfig) -> list[Path]:
    """The jars the job ships to Flink: `flink.jars` (default: the Kafka connector) and the helper
    jar (the Kafka key/value schemas and the micro-batcher)."""
    for jar in flink.jars:
        if not jar.is_file():
            raise ConfigError(f"flink.jars: jar not found: {jar} (list an existing flink-sql-connector-kafka jar, or none for the default)")
    return [*(flink.jars or [connector_jar()]), helper_jar()]


def connector_jar() -> Path:
    if prebuilt := os.environ.get(PREBUILT_ENV):
        return Path(prebuilt) / CONNECTOR_JAR
    version = CONNECTOR.rsplit(":", 1)[1]
    return _made(cache_dir() / "jars" / f"flink-sql-connector-kafka-{version}.jar", _fetch_connector,
                 f"fetching Flink's Kafka connector ({CONNECTOR}) from Maven Central")


def kafka_libs() -> Path:
    """The folder of the local broker's jars (Apache Kafka, as kafka-broker.pom.xml names it)."""
    return _made(cache_dir() / f"kafka-{_digest(BROKER_POM.read_bytes())}", _fetch_broker,
                 "fetching the Apache Kafka broker's jars from Maven Central")


def helper_jar() -> Path:
    if prebuilt := os.environ.get(PREBUILT_ENV):
        return Path(prebuilt) / HELPER_JAR
    sources = sorted(JAVA_SOURCES.glob("*.java"))
    key = _digest(CONNECTOR.encode(), *(source.read_bytes() for source in sources))
    connector = connector_jar()
    return _made(cache_dir() / "jars" / f"cluster-serving-flink-{key}.jar",
                 lambda target: _compile_helper(target, sources, connector), "compiling the helper jar")


def _made(target: Path, make: Callable[[Path], None], doing: str) -> Path:
    """`target`, made by `make` into a temporary path first when it is missing, under a lock so
    that processes starting together make it once."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".lock"):
        if not target.exists():
            print(f"[cluster-serving] {doing} (first use) into {target.parent}", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                made = Path(scratch) / target.name
                make(made)
                made.rename(target)
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _fetch_connector(target: Path) -> None:
    folder = target.parent
    _maven("dependency:copy", f"-Dartifact={CONNECTOR}", f"-DoutputDirectory={folder}", "-Dmdep.stripVersion=true")
    (folder / CONNECTOR_JAR).rename(target)


def _fetch_broker(target: Path) -> None:
    with tempfile.TemporaryDirectory() as work:  # Maven writes beside the pom: not into site-packages
        pom = Path(work) / "pom.xml"
        shutil.copyfile(BROKER_POM, pom)
        _maven("-f", str(pom), "dependency:copy-dependencies", f"-DoutputDirectory={target}", "-DincludeScope=runtime")


def _compile_helper(target: Path, sources: Sequence[Path], connector: Path) -> None:
    spec = importlib.util.find_spec("pyflink")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("apache-flink is not installed in this Python; the helper jar compiles against its jars")
    flink_lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    javac, jar = _tool("javac", "a JDK 17+ (javac) compiles the helper jar"), _tool("jar", "a JDK 17+ (jar) packs the helper jar")
    with tempfile.TemporaryDirectory() as classes:
        _run([javac, "-nowarn", "--release", "11", "-d", classes, "-cp", f"{flink_lib}/*:{connector}", *map(str, sources)])
        _run([jar, "cf", str(target), "-C", classes, "."])


def _maven(*args: str) -> None:
    mvn = _tool("mvn", "Apache Maven fetches the Kafka connector and broker jars from Maven Central on first use")
    _run([mvn, "-q", "-B", *args])


def _tool(name: str, why: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} not found on PATH: {why}; install it (e.g. apt install maven openjdk-17-jdk-headless)")
    return found


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()
        raise ConfigError(f"{Path(command[0]).name} failed (exit {done.returncode}): {' / '.join(output[-5:])}")


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:12]


def main() -> None:
    try:
        print(f"Kafka connector: {connector_jar()}\nhelper jar:      {helper_jar()}\nKafka broker:    {kafka_libs()}")
    except ConfigError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
