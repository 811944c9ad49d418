"""Swaps without downtime: the job's driver polls the model repository and, when what should be
served changes, writes the new routing table as a control record to every partition of the request
topic.

Why a record in the request stream rather than a control topic or a switch inside the job: the
switch point is then a position in the Kafka log. The JVM batcher flushes the batches it holds when
it reads the record, and the Python stage adopts the table after answering them, so requests before
the record are served by the old versions and those after it by the new. The table is checkpointed
with the Kafka positions, so a restore replays requests with the table that held when they were
first read, and meets the record again at the same place: nothing is served twice by two versions,
nothing is lost. Polling (as Triton's poll mode) needs nothing from the operator but copying a
folder; a version is checked by opening it here first, so a broken one is reported, once, and never
reaches the job while the version before it keeps serving.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kafka import KafkaProducer

from cluster_serving.config import ConfigError, ServingConfig
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.runtime.repository import Repository, RoutingTable, Servable, rescan, servable_stages
from cluster_serving.runtime.servables import open_version
from cluster_serving.job.control_key import sign
from cluster_serving.wire.codec import CONTROL_HEADER, SIGNATURE_HEADER

log = logging.getLogger(__name__)


def send_table(config: ServingConfig, table: RoutingTable, key: bytes) -> None:
    """The control record, signed with the job's `key`, on every partition of the request topic
    (each source reader must meet it)."""
    kafka = config.kafka
    text = table.text()
    headers = [(CONTROL_HEADER, b"table"), (SIGNATURE_HEADER, sign(key, text).encode())]
    producer = KafkaProducer(acks="all", **KafkaConnection.of(kafka).kafka_python())
    try:
        for partition in sorted(producer.partitions_for(kafka.input_topic) or [0]):
            producer.send(kafka.input_topic, value=text.encode(), partition=partition, headers=headers)
        producer.flush(30)
    finally:
        producer.close(5)


# A version file as the poller last checked it: path, modification time, size.
FileState = tuple[Path, float, int]


class RepositoryWatch:
    """What the running job was told to serve, and the check that tells it something new."""

    def __init__(self, config: ServingConfig, repository: Repository, table: RoutingTable, key: bytes):
        """`repository` as the job started with it, its served versions opened by the start checks
        (job.servables.repository_check): the first poll does not open them again. `key` signs tables."""
        self.config = config
        self.key = key
        self.repository = repository
        self.table = table
        self.checked: dict[tuple[str, int], tuple[FileState, bool]] = {
            (name, version): (state, True)
            for name, servable in repository.servables.items() if not servable.is_pipeline
            for version in servable.versions if (state := _state(servable.path(version))) is not None
        }
        self.reported: set[str] = set()

    def poll(self) -> RoutingTable | None:
        """Sends and returns a new table when the repository serves something else; None if not."""
        try:
            repository = rescan(self.config, self.repository)
        except ConfigError as exc:
            self._report(str(exc))
            return None
        for name, problem in repository.problems.items():
            self._report(f"model {name}: {problem}; {'its last good reading serves' if name in repository.servables else 'not served'}")
        left_out = frozenset(
            (name, version)
            for name, servable in repository.servables.items() if not servable.is_pipeline
            for version in servable.files if not self._opens(servable, version)
        )
        table = RoutingTable.of(repository, left_out)
        self.repository = repository
        if table.same_serving(self.table):
            return None
        send_table(self.config, table, self.key)
        log.info("repository changed: now serving %s (routing table %d sent)", table.describe(), table.generation)
        self.table = table
        return table

    def _opens(self, servable: Servable, version: int) -> bool:
        """Whether a version opens and fits its servable.yaml; checked once per state of its file."""
        state = _state(servable.path(version))
        if state is None:
            return False
        key = (servable.name, version)
        if key in self.checked and self.checked[key][0] == state:
            return self.checked[key][1]
        try:
            open_version(servable, version, self.config)
            servable_stages(servable)
            fits = True
        except Exception as exc:  # ModelError, ConfigError, or whatever servable.py raises on import
            log.error("model %s version %d not served: %s", servable.name, version, exc)
            fits = False
        self.checked[key] = (state, fits)
        return fits

    def _report(self, problem: str) -> None:
        if problem not in self.reported:
            self.reported.add(problem)
            log.error("repository: %s", problem)


def _state(path: Path) -> FileState | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return path, stat.st_mtime, stat.st_size
