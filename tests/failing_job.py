"""The serving job with an inference stage that fails once, on purpose, at its FAIL_AT_BATCH-th
batch: the recovery test's cluster_serving.job (`python -m tests.failing_job --config ...`).

The failure is injected here, through the job's `infer` parameter, so that the production stage
carries no test switch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cluster_serving.config import ServingConfig
from cluster_serving.job.main import main
from cluster_serving.job.operators import ServeBatch
from cluster_serving.runtime.decode import DecodedBatch
from cluster_serving.runtime.outcomes import Outcome

FAIL_AT_BATCH = 10
FAILURE = f"failing batch {FAIL_AT_BATCH} on purpose"


class FailOnceServeBatch(ServeBatch):
    def __init__(self, config: ServingConfig, marker: Path):
        super().__init__(config)
        # A file, because it must survive the task's restart (thread mode has no attempt number).
        self.marker = marker
        self.batches = 0

    def map(self, value: DecodedBatch) -> tuple[DecodedBatch, list[Outcome]]:
        if value.table is not None:  # a routing table, not a batch
            return super().map(value)
        self.batches += 1
        if self.batches == FAIL_AT_BATCH and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
            raise RuntimeError(FAILURE)
        return super().map(value)


def failing_stage(config: ServingConfig) -> FailOnceServeBatch:
    return FailOnceServeBatch(config, config.flink.checkpoint_dir / "failed-once")


if __name__ == "__main__":
    # Imported by its module name, so that Flink pickles the stage by reference, not from __main__.
    from tests.failing_job import failing_stage as stage

    sys.exit(main(infer=stage))
