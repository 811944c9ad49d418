"""The local development broker: Apache Kafka itself, one KRaft node that is broker and controller.

Its jars come from Maven Central on first use (`cluster_serving.jvm.kafka_libs`, see
`cluster_serving/jvm/kafka-broker.pom.xml` for the version). It listens on 127.0.0.1 only and keeps its
data in a folder (`--data`, default `run/kafka`) across restarts; `--fresh` wipes it first.
Everything else about it is stock Kafka: production points `kafka.bootstrap_servers` at its own
cluster and nothing in the project changes.

Layout of the data folder:

    server.properties   written at every start (ports may change between starts)
    log4j2.properties   the broker's logging
    broker.log          the broker's own log (WARN and the lifecycle lines)
    log/                Kafka's log.dirs: topics, offsets, transactions, the KRaft metadata log

Run it in the foreground::

    python -m cluster_serving.ops.local_broker --port 9092 --topic requests:3

or from Python, as a separate process, with ``ops.children.LocalBroker``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import fcntl
import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import KafkaException
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from cluster_serving.config import KAFKA_RECORD_BYTES, ConfigError, load_config
from cluster_serving.jvm import find_java, kafka_libs
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.net.ports import port_taken
from cluster_serving.ops.broker_security import SECURE_FOLDER, BrokerSecurity
from cluster_serving.ops.certificates import write_file

log = logging.getLogger(__name__)

READY_PREFIX = "local Kafka broker ready on "
LOOPBACK = "127.0.0.1"
BROKER_LOG = "broker.log"
# Logged by this broker once it serves (kafka.server.KafkaRaftServer, kept at INFO below).
SERVER_STARTED = "Kafka Server started"
# The JVM's heap: the broker of one developer's topics needs little; Flink shares the machine.
# The parallel collector in a heap of fixed size and fixed generations, not Kafka's usual G1: on a
# few cores shared with the job and its clients, every pause stalls each request in flight, and
# this collector pauses least often and briefest; a heap that may grow once paused it for
# hundreds of milliseconds as it grew (docs/benchmarks.md, "Tuning history").
JVM_OPTIONS = ["-Xms1g", "-Xmx1g", "-XX:+UseParallelGC", "-XX:-UseAdaptiveSizePolicy", "-Djava.awt.headless=true"]

# One node, so every internal topic has one replica. Group joins are not held back for late
# members (Kafka's 3 s default suits clusters of many consumers, not a developer's machine), and
# the internal topics get fewer partitions than the 50 a cluster uses: each costs start-up time.
SINGLE_NODE_SETTINGS = {
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "8",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # The project's one record limit (conf.KAFKA_RECORD_BYTES) instead of Kafka's 1 MiB.
    "message.max.bytes": str(KAFKA_RECORD_BYTES),
    "replica.fetch.max.bytes": str(KAFKA_RECORD_BYTES),
    # The log cleaner's key map for compacted topics (here only the group offsets): Kafka's 128 MiB
    # default sized for a cluster's, and held for the broker's life. The heap after a collection:
    # 158 MB -> 51 MB.
    "log.cleaner.dedupe.buffer.size": str(16 << 20),
}

LOG4J2 = """\
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
# "[KafkaRaftServer nodeId=1] Kafka Server started" and the shutdown lines
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
"""


class BrokerError(Exception):
    """A reason the broker cannot start, said in one line."""


def kafka_version(libs: Path | None = None) -> str:
    """The broker's version, read from the name of its jar (kafka_2.13-<version>.jar)."""
    libs = libs or kafka_libs()
    jars = sorted(libs.glob("kafka_2.13-*.jar"))
    if not jars:
        raise BrokerError(f"no Kafka broker jars in {libs}; remove the folder and start again to fetch them")
    return jars[0].stem.removeprefix("kafka_2.13-")


def pick_port(host: str = LOOPBACK) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def data_in_use(data: Path) -> bool:
    """True while a broker runs on this data folder. Kafka holds a POSIX lock on `log/.lock` for
    its life (FileChannel.tryLock); probing that lock, before anything is written or wiped, keeps
    a second broker (another port, or `--fresh`) from rewriting the running one's folder."""
    try:
        handle = (data / "log" / ".lock").open("rb+")
    except OSError:
        return False
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.lockf(handle, fcntl.LOCK_UN)
    return False


def server_properties(data: Path, port: int, controller_port: int) -> dict[str, str]:
    """A one-node KRaft broker on loopback. The controller listener gets a port of its own, chosen
    at each start: with a static voter set its address is read from here, never from the data."""
    return {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{LOOPBACK}:{controller_port}",
        "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data / "log"),
        **SINGLE_NODE_SETTINGS,
    }


def write_settings(data: Path, port: int, security: BrokerSecurity | None = None) -> Path:
    """Writes server.properties and log4j2.properties into the data folder; returns the former."""
    data.mkdir(parents=True, exist_ok=True)
    controller_port = pick_port()
    properties = server_properties(data, port, controller_port)
    if security:
        properties |= security.server_properties(port, controller_port, LOOPBACK)
    path = data / "server.properties"
    # Owner-only: a secured broker's settings hold its admin password.
    write_file(path, "".join(f"{key}={value}\n" for key, value in properties.items()).encode(), private=True)
    (data / "log4j2.properties").write_text(LOG4J2.format(log_file=data / BROKER_LOG))
    return path


def java_command(main_class: str, *args: str, data: Path, libs: Path | None = None) -> list[str]:
    java = find_java()
    logging_config = f"-Dlog4j2.configurationFile={data / 'log4j2.properties'}"
    return [java, *JVM_OPTIONS, logging_config, "-cp", f"{libs or kafka_libs()}/*", main_class, *args]


def format_storage(data: Path, properties: Path, security: BrokerSecurity | None = None) -> None:
    """Formats an empty data folder for a new cluster (what `kafka-storage.sh format` does), with
    the SCRAM users of a secured broker."""
    if (data / "log" / "meta.properties").exists():
        return
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    # `--cluster-id=ID` in one argument: an id may start with '-' (a 1 in 64 chance), which the
    # tool's parser took for an option ("argument --cluster-id/-t: expected one argument").
    users = security.format_arguments() if security else []
    command = java_command("kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(properties), *users,
                           data=data)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BrokerError(f"formatting {data / 'log'} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    log.info("formatted %s for the new cluster %s", data / "log", cluster_id)


def _die_with_parent() -> None:
    """Runs in the broker's JVM before exec: the kernel sends it SIGTERM when this process dies,
    so a killed supervisor never leaves a broker behind holding the port and the data folder."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_serving(process: subprocess.Popen[bytes], admin: KafkaConnection, broker_log: Path, log_from: int,
                       timeout_s: float) -> None:
    """Until this broker logs that it started and a Kafka client gets an answer. Its own log line,
    not an open port, says the broker is ours: another broker starting at the same moment on the
    same port would answer for it while this one failed to bind."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BrokerError(f"the broker exited with {process.returncode}: {_first_failure(broker_log, log_from)}")
        if SERVER_STARTED not in _log_since(broker_log, log_from):
            time.sleep(0.1)
            continue
        try:
            client = KafkaAdminClient(request_timeout_ms=2000, **admin.kafka_python())
        except KafkaError:
            time.sleep(0.05)
            continue
        client.close()
        return
    raise BrokerError(f"the broker did not serve within {timeout_s:.0f} s; see {broker_log}")


def _log_since(broker_log: Path, offset: int) -> str:
    """What the broker logged in this start (the log is kept across starts)."""
    try:
        with broker_log.open("rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _first_failure(broker_log: Path, offset: int) -> str:
    """The first exception message of this start, e.g. "Socket server failed to bind to
    127.0.0.1:9092: Address already in use.", and where the rest is."""
    lines = _log_since(broker_log, offset).splitlines()
    reason = next((line.split("Exception: ", 1)[1] for line in lines if "Exception: " in line), "no reason logged")
    return f"{reason} (see {broker_log})"


def create_topics(connection: KafkaConnection, topics: list[tuple[str, int]]) -> None:
    if not topics:
        return
    admin = KafkaAdminClient(**connection.kafka_python())
    try:
        for name, partitions in topics:
            try:
                admin.create_topics([NewTopic(name, partitions, 1)])
            except TopicAlreadyExistsError:
                log.info("topic %s exists already; its partitions are kept", name)
    finally:
        admin.close()


def admin_connection(port: int, security: BrokerSecurity | None) -> KafkaConnection:
    """How this process reaches the broker as its administrator."""
    return KafkaConnection(f"{LOOPBACK}:{port}", security.client_properties("admin") if security else {})


def start(
    data: Path, port: int, fresh: bool, libs: Path | None = None, secure: bool = False
) -> tuple[subprocess.Popen[bytes], BrokerSecurity | None]:
    """Starts the broker's JVM (formatting the folder first when new); returns it once it serves,
    with its security settings when `secure` (TLS, SCRAM users and ACLs: cluster_serving/ops/broker_security.py)."""
    version = kafka_version(libs)
    find_java()
    if port_taken(LOOPBACK, port):
        raise BrokerError(f"{LOOPBACK}:{port} is in use; stop what listens there or pick --port")
    if data_in_use(data):
        raise BrokerError(f"{data} is the data folder of a broker that runs now; stop it, or pick another --data")
    if fresh and data.exists():
        shutil.rmtree(data)
        log.info("--fresh: removed %s", data)
    security = secure_settings(data) if secure else None
    properties = write_settings(data, port, security)
    format_storage(data, properties, security)
    command = java_command("kafka.Kafka", str(properties), data=data, libs=libs)
    log.info("starting Apache Kafka %s (KRaft, one node), data in %s", version, data)
    broker_log = data / BROKER_LOG
    log_from = broker_log.stat().st_size if broker_log.exists() else 0
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        wait_until_serving(process, admin_connection(port, security), broker_log, log_from, timeout_s=60)
    except BaseException:
        stop(process)
        raise
    return process, security


def secure_settings(data: Path) -> BrokerSecurity:
    """The secured broker's users and certificates; a folder formatted without them cannot serve them."""
    if (data / "log" / "meta.properties").exists() and not (data / SECURE_FOLDER).exists():
        raise BrokerError(f"{data} holds a broker started without --secure, which has no users; add --fresh or pick another --data")
    return BrokerSecurity.of(data)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGTERM is Kafka's controlled shutdown (logs flushed, clean-shutdown marker written)."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the broker did not stop within %.0f s; killing it", timeout_s)
            process.kill()
    return process.wait()


def _parse_topic(text: str) -> tuple[str, int]:
    name, _, partitions = text.rpartition(":")
    if not name or not partitions.isdigit() or int(partitions) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME:PARTITIONS (e.g. requests:3), got {text!r}")
    return name, int(partitions)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cluster_serving.ops.local_broker",
        description="Apache Kafka (KRaft, one node) on 127.0.0.1 for development and tests.",
    )
    parser.add_argument("--port", type=int, default=9092, help="port to listen on; 0 picks a free one (default 9092)")
    parser.add_argument("--data", type=Path, default=Path("run/kafka"), help="data folder, kept across restarts (default run/kafka)")
    parser.add_argument("--fresh", action="store_true", help="wipe the data folder before starting")
    parser.add_argument(
        "--topic", type=_parse_topic, action="append", default=[], metavar="NAME:PARTITIONS",
        help="topic to create at start when missing; repeatable",
    )
    parser.add_argument("--secure", action="store_true",
                        help="TLS, SASL/SCRAM users and ACLs; prints the client settings (see docs/security.md)")
    parser.add_argument("--request-topic",
                        help="with --secure: the topic user `requester` may write (default: the config's kafka.input_topic)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the broker in the foreground until SIGINT/SIGTERM; returns the exit status."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # refused connections while it starts
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_stop)
    began = time.monotonic()
    port = args.port or pick_port()
    data = args.data.resolve()
    try:
        process, security = start(data, port, args.fresh, secure=args.secure)
        admin = admin_connection(port, security)
        create_topics(admin, args.topic)
        if security:
            security.grant(admin, args.request_topic or load_config().kafka.input_topic)
    except (BrokerError, ConfigError, OSError, KafkaException) as exc:  # OSError: a data folder that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if security:
        client_file = security.write_client_file()
        print(f"secured: TLS, SASL/SCRAM and ACLs; the client settings ({client_file}):\n{client_file.read_text()}",
              end="", flush=True)
    print(f"{READY_PREFIX}{LOOPBACK}:{port} in {time.monotonic() - began:.1f} s (data: {data})", flush=True)
    while not stopping and process.poll() is None:
        time.sleep(0.2)
    if not stopping:
        log.error("the broker exited by itself with %s; see %s", process.returncode, data / BROKER_LOG)
        return 1
    log.info("stopping the broker")
    code = stop(process)
    log.info("stopped (exit %s)", code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
