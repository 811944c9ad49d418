"""`cluster-serving replay`: a range of the request log served again into a side topic, by a bounded
job beside the live one, through the repository as it is now or through one model version for
every request; then, with `--compare`, how the side results differ from the live ones.

    cluster-serving replay --from 2026-11-26T10:00 [--to 2026-11-26T11:00] --model m --version 2 --into side --compare
    (or python -m cluster_serving.job.replay ...)

The range is positions of the input topic, the same in every partition: an offset, or a time (the
first record written at or after it; ISO 8601, local time unless it names a zone); `--to` left out
is the end of the log when the replay starts. The replay job is the live job's pipeline with
another source and sink: it reads every partition from its start to its stop offsets and ends
there, under a group id of its own, without checkpoints (it commits nothing), without dead letters,
and its results go to the side topic. Control records in the range are dropped: it serves the
table it starts with. The live job is not touched. The comparison is the check to make before
promoting a version.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from cluster_serving.config import ConfigError, KafkaConfig, ServingConfig, load_config
from cluster_serving.config.command_line import config_parser
from cluster_serving.job.kafka_io import replay_source
from cluster_serving.job.main import JobFailed, build_pipeline, configure_logging, create_environment, exit_code, preflight
from cluster_serving.kafka.admin import end_offsets, log_positions, records_written, topic_records
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.runtime.repository import Repository, RoutingTable, scan
from cluster_serving.wire.codec import Message, decode_message
from cluster_serving.wire.open_inference import decode_answer

log = logging.getLogger("cluster_serving.job")

REPLAY_JOB_NAME = "cluster-serving replay"
# Where requests go when the replay names a model: (model, version or None for its newest).
Route = tuple[str, int | None]


def replay_config(config: ServingConfig, into: str) -> ServingConfig:
    """The live config with the replay's own group, side topic, no dead letters, at least once,
    and the embedded Flink's REST API on a free port (the live job may hold its own)."""
    kafka = config.kafka.model_copy(update={
        "group_id": f"{config.kafka.group_id}-replay", "result_topic": into, "dead_letter_topic": "",
        "delivery": "at_least_once",
    })
    return config.model_copy(update={"kafka": kafka, "flink": config.flink.model_copy(update={"rest_port": 0})})


def replay_table(repository: Repository, route: Route | None) -> RoutingTable:
    """The repository's table; with a route, its model is the default and serves only that version."""
    table = RoutingTable.of(repository)
    if route is None:
        return table
    model, version = route
    servable = repository.servables.get(model)
    if servable is None:
        raise ConfigError(f"--model: no model {model!r} in the repository (it has {', '.join(sorted(repository.servables))})")
    entry = table.entries[model]
    if version is not None:
        if version not in servable.files:
            raise ConfigError(f"--version: model {model!r} has no version {version} (it has {sorted(servable.files)})")
        entry = dataclasses.replace(entry, versions=(version,))
    return dataclasses.replace(table, default=model, entries={**table.entries, model: entry})


def run_replay(
    config: ServingConfig, repository: Repository, starts: dict[int, int], stops: dict[int, int],
    route: Route | None, progress: Callable[[], None],
) -> None:
    """Runs the replay job (`config` a replay_config) to its end, calling `progress` every second.
    Its Flink log goes to the `replay` folder of the live job's, so that neither writes the other's."""
    os.environ.setdefault("FLINK_LOG_DIR", str(config.flink_log_dir / "replay"))
    table = replay_table(repository, route)
    env = create_environment(config, None, checkpoints=False)
    forced = None if route is None else (route[0], None if route[1] is None else str(route[1]))
    build_pipeline(env, config, table, replay_source(config.kafka, starts, stops, forced))
    client = env.execute_async(REPLAY_JOB_NAME)
    log.info("replay job %s submitted: serving %s into %s", client.get_job_id(), table.describe(), config.kafka.result_topic)
    # The embedded cluster closes with the job, so its end is awaited, not polled for.
    ended = client.get_job_execution_result()
    while not ended.done():
        progress()
        time.sleep(1)
    try:
        ended.result()
    except Exception as exc:  # py4j's error around the job's failure
        raise JobFailed(f"the replay job failed: {str(exc).splitlines()[0]} (see the Flink log in "
                        f"{os.environ['FLINK_LOG_DIR']})") from None


# A result read back from a topic may be as large as a record.
RESULT_LIMIT = 64 << 20


def position(text: str) -> int | datetime:
    """`--from`/`--to`: an offset (digits) or an ISO 8601 time."""
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an offset nor a time such as 2026-11-26T10:00:00") from None
    return moment if moment.tzinfo else moment.astimezone()


@dataclass
class Comparison:
    """How the side results differ from the live ones, uri by uri."""

    replayed: int = 0
    matched: int = 0
    top1_agree: int = 0
    compared: int = 0
    largest_difference: float = 0.0
    side_errors: int = 0
    live_errors: int = 0

    def lines(self) -> list[str]:
        share = f" ({100 * self.top1_agree / self.compared:.2f}%)" if self.compared else ""
        return [
            f"compared: {self.replayed} replayed results, {self.matched} with a live result for the same uri",
            f"top-1 agreement: {self.top1_agree} of {self.compared}{share}",
            f"largest absolute difference: {self.largest_difference:.6g}",
            f"errors: {self.side_errors} in the replay, {self.live_errors} live",
        ]


def compare(side: dict[str, Message], live: dict[str, Message]) -> Comparison:
    """Side and live results of the same uris: top-1 of the first output both have, and the largest
    absolute difference over every output both have with one shape."""
    found = Comparison(replayed=len(side))
    for uri, replayed in side.items():
        served = live.get(uri)
        if served is None:
            continue
        found.matched += 1
        found.side_errors += replayed.error is not None
        found.live_errors += served.error is not None
        common = [name for name in replayed.tensors if name in served.tensors
                  and np.shape(replayed.tensors[name]) == np.shape(served.tensors[name])]
        if replayed.error is not None or served.error is not None or not common:
            continue
        found.compared += 1
        first = common[0]
        found.top1_agree += int(np.argmax(replayed.tensors[first]) == np.argmax(served.tensors[first]))
        for name in common:
            difference = np.abs(np.asarray(replayed.tensors[name], np.float64) - np.asarray(served.tensors[name], np.float64))
            found.largest_difference = max(found.largest_difference, float(difference.max(initial=0.0)))
    return found


def read_results(kafka: KafkaConfig, topic: str, since=None, uris: set[str] | None = None) -> dict[str, Message]:
    """The results on `topic` (from `since`, or its start), the last one per uri, read_committed;
    OIP answers as results too."""
    results = {}
    client = KafkaConnection.of(kafka).kafka_python()  # a secured Kafka's settings too
    for record in topic_records(topic=topic, isolation_level="read_committed", since=since, **client):
        uri = record.key.decode(errors="replace") if record.key else None
        if uri is None or (uris is not None and uri not in uris):
            continue
        try:
            results[uri] = decode_answer(record.value) or decode_message(record.value, RESULT_LIMIT)
        except Exception as exc:  # a record that is no result: a writer other than the job
            print(f"replay: skipping a record of {topic} under uri={uri}: {exc}", file=sys.stderr)
    return results


class Progress:
    """Prints, at most every 2 s, how many results the replay has written of the records in range."""

    def __init__(self, config: ServingConfig, total: int):
        self.config, self.total = config, total
        self.started = self.shown = time.monotonic()
        self.before = self._written()

    def _written(self) -> int:
        kafka = self.config.kafka
        return records_written([kafka.result_topic], **KafkaConnection.of(kafka).kafka_python())[kafka.result_topic]

    def __call__(self) -> None:
        if time.monotonic() - self.shown < 2:
            return
        self.shown = time.monotonic()
        done = self._written() - self.before
        rate = done / max(self.shown - self.started, 1e-9)
        print(f"replay: {done} results of {self.total} records in range ({rate:.0f}/s)", file=sys.stderr)


def log_range(kafka: KafkaConfig, start: int | datetime, stop: int | datetime | None) -> tuple[dict[int, int], dict[int, int]]:
    """The input topic's offsets (partition -> offset) where the range starts and stops; a stop
    before its start is an empty range."""
    starts = log_positions(kafka, kafka.input_topic, start)
    stops = log_positions(kafka, kafka.input_topic, stop)
    return starts, {partition: max(offset, starts[partition]) for partition, offset in stops.items()}


def replay(args: argparse.Namespace) -> int:
    """The `replay` command: plan, run, report (and compare)."""
    if args.version is not None and args.model is None:
        raise ConfigError("--version needs --model: the model whose version serves the replay")
    config = load_config(args.config)
    if args.into in (config.kafka.input_topic, config.kafka.result_topic):
        raise ConfigError(f"--into {args.into}: the replay writes to a side topic, not the job's own")
    configure_logging()
    # The range is read with consumers of no group, on purpose: kafka-python warns of each.
    logging.getLogger("kafka.coordinator.consumer").setLevel(logging.ERROR)
    side = replay_config(config, args.into)
    route = None if args.model is None else (args.model, args.version)
    replay_table(scan(side), route)  # an unknown model or version refused before anything starts
    repository = preflight(side)  # the side topic made, the models checked, the live job's port left alone
    starts, stops = log_range(config.kafka, args.start, args.stop)
    total = sum(stops[partition] - starts[partition] for partition in stops)
    since = end_offsets(topic=args.into, **KafkaConnection.of(side.kafka).kafka_python())
    print(f"replay: {total} records of {config.kafka.input_topic} (partition: from..to "
          f"{', '.join(f'{p}: {starts[p]}..{stops[p]}' for p in sorted(starts))}) into {args.into}", file=sys.stderr)
    run_replay(side, repository, starts, stops, route, Progress(side, total))
    replayed = read_results(side.kafka, args.into, since)
    print(f"replayed: {len(replayed)} results written to {args.into}")
    if args.compare:
        live = read_results(config.kafka, config.kafka.result_topic, uris=set(replayed))
        for line in compare(replayed, live).lines():
            print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("cluster-serving replay", "serve a range of the request log again into a side topic (and compare)")
    parser.add_argument("--from", dest="start", type=position, required=True, metavar="TIME|OFFSET",
                        help="where the range starts in every partition: an offset, or an ISO 8601 time")
    parser.add_argument("--to", dest="stop", type=position, metavar="TIME|OFFSET",
                        help="where it ends (that record not included; default: the end of the log at start)")
    parser.add_argument("--model", help="serve every request with this model (default: as each request names)")
    parser.add_argument("--version", type=int, help="with --model: this version of it (default: its newest served)")
    parser.add_argument("--into", required=True, metavar="TOPIC", help="the side topic the results go to")
    parser.add_argument("--compare", action="store_true",
                        help="then compare with the live results for the same uris: count, top-1 agreement, largest difference")
    parser.add_argument("--verbose", action="store_true", help="on an error, print its traceback too")
    args = parser.parse_args(argv)
    return exit_code(lambda: replay(args), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
