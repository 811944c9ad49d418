"""Replay: a range of the request log served again into a side topic, by a bounded job beside the
live one, through the repository as it is now or through one model version for every request.

The replay job is the live job's pipeline with another source and sink: it reads every partition
of the input topic from its start to its stop offsets and ends there, under a group id of its own,
without checkpoints (it commits nothing), without dead letters, and its results go to the side
topic. Control records in the range are dropped: it serves the table it starts with. The live job
is not touched. `cluster-serving replay` (cluster_serving/ops/replay.py) plans the range and
compares the side results with the live ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from cluster_serving.config import ConfigError, ServingConfig
from cluster_serving.job.kafka_io import replay_source
from cluster_serving.job.main import build_pipeline, create_environment
from cluster_serving.runtime.repository import Repository, RoutingTable

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
        raise RuntimeError(f"the replay job failed: {str(exc).splitlines()[0]} (see the Flink log in "
                           f"{os.environ['FLINK_LOG_DIR']})") from None
