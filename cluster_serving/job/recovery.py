"""Where the job resumes from: the newest retained checkpoint or final savepoint of an earlier run.

Flink commits the source's Kafka offsets when a checkpoint completes, while requests of that
checkpoint may still wait in the micro-batcher's state. A fresh job that started from the
committed offsets alone would never answer those requests, so the job keeps its checkpoints after
it stops or dies (RETAIN_ON_CANCELLATION), takes a savepoint when it is stopped, and the next
start restores the newest of them: the batcher's waiting requests and the source's exact
positions come back together.

Flink's layout: <checkpoint_dir>/<job id>/chk-<n>/_metadata for checkpoints, and here
<checkpoint_dir>/savepoints/savepoint-<...>/_metadata for final savepoints. `_metadata` is written
last, so a folder without it was cut off and is skipped.
"""

from __future__ import annotations

import logging
import shutil
from itertools import chain
from pathlib import Path

from cluster_serving.config import FlinkConfig

log = logging.getLogger(__name__)


def latest_checkpoint(flink: FlinkConfig) -> Path | None:
    """The newest complete checkpoint or savepoint under `flink.checkpoint_dir` (the folder holding
    `_metadata`)."""
    found = chain(flink.checkpoint_dir.glob("*/chk-*/_metadata"), flink.savepoint_dir.glob("*/_metadata"))
    complete = [metadata.parent for metadata in found]
    return max(complete, key=lambda state: (state / "_metadata").stat().st_mtime, default=None)


def prune_other_runs(flink: FlinkConfig, keep: Path) -> None:
    """Removes what earlier runs left but the state being restored: once the new run has
    checkpointed, none of it is needed again (Flink restores in NO_CLAIM mode)."""
    runs = [path for path in flink.checkpoint_dir.iterdir() if path.is_dir() and path != flink.savepoint_dir]
    for path in chain(runs, flink.savepoint_dir.glob("*")):
        if path.is_dir() and path not in (keep, keep.parent):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the state of an earlier run: %s", path)
