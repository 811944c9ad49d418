"""Where the job resumes from: the newest retained checkpoint of an earlier run, if any.

Flink commits the source's Kafka offsets when a checkpoint completes, while requests of that
checkpoint may still wait in the micro-batcher's state. A fresh job that started from the
committed offsets alone would never answer those requests, so the job keeps its checkpoints after
it stops or dies (RETAIN_ON_CANCELLATION) and the next start restores the newest one: the
batcher's waiting requests and the source's exact positions come back together.

Flink's layout: <checkpoint_dir>/<job id>/chk-<n>/_metadata; `_metadata` is written last, so a
checkpoint without it was cut off and is skipped.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint under `checkpoint_dir` (the folder holding `_metadata`)."""
    complete = [metadata.parent for metadata in checkpoint_dir.glob("*/chk-*/_metadata")]
    if not complete:
        return None
    return max(complete, key=lambda chk: ((chk / "_metadata").stat().st_mtime, int(chk.name[4:])))


def prune_other_runs(checkpoint_dir: Path, keep: Path) -> None:
    """Removes the checkpoint folders of earlier runs but the one being restored: once the new run
    has checkpointed, none of them is needed again (Flink restores in NO_CLAIM mode)."""
    for run in checkpoint_dir.iterdir():
        if run.is_dir() and run != keep.parent:
            shutil.rmtree(run, ignore_errors=True)
            log.info("removed the checkpoints of an earlier run: %s", run)
