"""In-memory Kafka broker for local development and tests.

This is NOT a Kafka server: it is librdkafka's in-memory mock cluster (shipped inside the
confluent-kafka wheel, reached through ctypes) behind a small protocol front
(``connectors.kafka_front``) that lets Java kafka-clients and kafka-python talk to it. All
data lives in memory and is lost when the process exits. Production deployments point
``kafka.bootstrap_servers`` at a real Kafka cluster instead.

What works: topic creation (CreateTopics, the ``--topic`` option, or automatic creation with
the mock's default of 4 partitions when a client asks Metadata for an unknown topic with
auto-creation allowed), deletion (DeleteTopics), produce (acks 0/1/all, idempotent and
transactional producers), fetch, consumer groups with committed offsets.

Limits of the mock:

* each partition keeps only its newest ~5 MiB (or 100,000 batches); older records are
  dropped, and a consumer further behind skips them (its position resets to the log start);
* read_committed consumers also see aborted and still-open transactional records;
* a rebalance after a group's first one (a member joins or leaves) takes the capped session
  timeout minus one second (``SESSION_TIMEOUT_CAP_MS``);
* no DescribeGroups, ListGroups, DescribeConfigs, SASL, TLS or other admin APIs.

Run it in the foreground::

    python -m connectors.local_broker --port 9092 --topic requests:3

or from Python, always as a separate process, with ``client.processes.LocalBroker``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.util
import ipaddress
import logging
import signal
import sys
from ctypes import c_char_p, c_int, c_int32, c_size_t, c_void_p
from pathlib import Path

from connectors.kafka_front import KafkaFront

log = logging.getLogger("connectors.local_broker")

READY_PREFIX = "local broker ready on "

BROKER_ID = 1
# The mock waits this long after the first member joins an empty group before it elects a
# leader, so that members starting together land in one generation (Kafka's default is 3 s).
INITIAL_REBALANCE_DELAY_MS = 500
# Every later rebalance lasts the group's session timeout minus one second in the mock, so
# JoinGroup session timeouts are capped (Java's default is 45 s). Heartbeats every 3 s
# (both clients' default) keep members well inside this.
SESSION_TIMEOUT_CAP_MS = 10_000
# About what the mock keeps per partition before it drops the oldest records (measured; see the
# module docstring). Whoever fills a topic with a backlog sizes its partitions by it.
PARTITION_KEEPS_BYTES = 5 * 1024 * 1024

_RD_KAFKA_PRODUCER = 0
_REQUIRED_SYMBOLS = (
    "rd_kafka_mock_cluster_new",
    "rd_kafka_mock_cluster_bootstraps",
    "rd_kafka_mock_broker_set_host_port",
    "rd_kafka_mock_set_controller_id",
    "rd_kafka_mock_group_initial_rebalance_delay_ms",
    "rd_kafka_mock_topic_create",
    "rd_kafka_mock_topic_delete",
)


def _load_librdkafka() -> ctypes.CDLL:
    """Load the librdkafka bundled in the confluent-kafka wheel and declare what we call."""
    spec = importlib.util.find_spec("confluent_kafka")
    if spec is None or spec.origin is None:
        raise RuntimeError("confluent-kafka is not installed; it carries the mock cluster")
    libs_dir = Path(spec.origin).parent.parent / "confluent_kafka.libs"
    candidates = sorted(libs_dir.glob("librdkafka*.so*"))
    if not candidates:
        raise RuntimeError(f"no librdkafka shared library in {libs_dir}")
    lib = ctypes.CDLL(candidates[0])

    lib.rd_kafka_version_str.restype = c_char_p
    missing = [name for name in _REQUIRED_SYMBOLS if not hasattr(lib, name)]
    if missing:
        version = lib.rd_kafka_version_str().decode()
        raise RuntimeError(
            f"librdkafka {version} lacks {', '.join(missing)}; upgrade confluent-kafka"
        )

    signatures = {
        "rd_kafka_conf_new": (c_void_p, []),
        "rd_kafka_conf_set": (c_int, [c_void_p, c_char_p, c_char_p, c_char_p, c_size_t]),
        "rd_kafka_new": (c_void_p, [c_int, c_void_p, c_char_p, c_size_t]),
        "rd_kafka_destroy": (None, [c_void_p]),
        "rd_kafka_mock_cluster_new": (c_void_p, [c_void_p, c_int]),
        "rd_kafka_mock_cluster_destroy": (None, [c_void_p]),
        "rd_kafka_mock_cluster_bootstraps": (c_char_p, [c_void_p]),
        "rd_kafka_mock_broker_set_host_port": (None, [c_void_p, c_int32, c_char_p, c_int]),
        "rd_kafka_mock_set_controller_id": (None, [c_void_p, c_int32]),
        "rd_kafka_mock_group_initial_rebalance_delay_ms": (None, [c_void_p, c_int32]),
        "rd_kafka_mock_topic_create": (c_int, [c_void_p, c_char_p, c_int, c_int]),
        "rd_kafka_mock_topic_delete": (c_int, [c_void_p, c_char_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


class MockCluster:
    """A one-broker librdkafka mock cluster.

    librdkafka only creates a mock cluster on behalf of a client handle, so an idle producer
    handle (never connected anywhere) owns it.
    """

    def __init__(self) -> None:
        self._lib = _load_librdkafka()
        errstr = ctypes.create_string_buffer(512)
        conf = self._lib.rd_kafka_conf_new()
        # Hide the owner handle's notice that it has no bootstrap.servers.
        self._lib.rd_kafka_conf_set(conf, b"log_level", b"4", errstr, len(errstr))
        self._rk = self._lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, errstr, len(errstr))
        if not self._rk:
            raise RuntimeError(f"rd_kafka_new failed: {errstr.value.decode()}")
        self._cluster = self._lib.rd_kafka_mock_cluster_new(self._rk, 1)
        if not self._cluster:
            self._lib.rd_kafka_destroy(self._rk)
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        bootstraps = self._lib.rd_kafka_mock_cluster_bootstraps(self._cluster).decode()
        host, port = bootstraps.rsplit(":", 1)
        self.listener = (host, int(port))
        self._lib.rd_kafka_mock_set_controller_id(self._cluster, BROKER_ID)
        self._lib.rd_kafka_mock_group_initial_rebalance_delay_ms(
            self._cluster, INITIAL_REBALANCE_DELAY_MS
        )

    def advertise(self, host: str, port: int) -> None:
        """Make Metadata responses send clients to host:port (the front) instead of the mock."""
        self._lib.rd_kafka_mock_broker_set_host_port(self._cluster, BROKER_ID, host.encode(), port)

    def create_topic(self, name: str, partitions: int) -> int:
        error = self._lib.rd_kafka_mock_topic_create(self._cluster, name.encode(), partitions, 1)
        if error:
            log.info("topic %s not created: Kafka error %d", name, error)
        else:
            log.info("topic created: %s (%d partitions)", name, partitions)
        return error

    def delete_topic(self, name: str) -> int:
        error = self._lib.rd_kafka_mock_topic_delete(self._cluster, name.encode())
        if error:
            log.info("topic %s not deleted: Kafka error %d", name, error)
        else:
            log.info("topic deleted: %s", name)
        return error

    def close(self) -> None:
        self._lib.rd_kafka_mock_cluster_destroy(self._cluster)
        self._lib.rd_kafka_destroy(self._rk)


def _parse_topic(spec: str) -> tuple[str, int]:
    name, sep, partitions = spec.rpartition(":")
    if not sep or not name or not partitions.isdigit() or int(partitions) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME:PARTITIONS, got {spec!r}")
    return name, int(partitions)


def _loopback_host(host: str) -> str:
    try:
        loopback = ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise argparse.ArgumentTypeError(
            f"the development broker binds 127.x.x.x addresses only, got {host!r}"
        )
    return host


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m connectors.local_broker",
        description="In-memory development Kafka broker (data is lost on exit).",
    )
    parser.add_argument(
        "--host", type=_loopback_host, default="127.0.0.1", help="loopback address to bind"
    )
    parser.add_argument(
        "--port", type=int, default=9092, help="port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--session-timeout-cap-ms",
        type=int,
        default=SESSION_TIMEOUT_CAP_MS,
        help="upper bound for consumer group session timeouts; each rebalance after a "
        "group's first one takes this minus one second",
    )
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG logs every request)"
    )
    parser.add_argument(
        "--topic",
        type=_parse_topic,
        action="append",
        default=[],
        metavar="NAME:PARTITIONS",
        help="topic to create at start; repeatable",
    )
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT; return the process exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    cluster = MockCluster()
    front = KafkaFront(cluster, cluster.listener, args.session_timeout_cap_ms)
    try:
        bound_port = await front.start(args.host, args.port)
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, error)
        cluster.close()
        return 1
    try:
        cluster.advertise(args.host, bound_port)
        for name, partitions in args.topic:
            cluster.create_topic(name, partitions)
        print(f"{READY_PREFIX}{args.host}:{bound_port}", flush=True)
        await stop.wait()
        log.info("stopping")
    finally:
        await front.close()
        cluster.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the broker in the foreground; return the exit status."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
