"""A restart (`cluster-serving restart`, EmbeddedJob.restart) stops the job with a final savepoint
and submits it again from there in the job process's own JVM, whose JIT-compiled code the new job
runs on; new flink.jvm_options need a new JVM, so the process is then started again. Either way
every request is answered once."""

from __future__ import annotations

import numpy as np
import yaml

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import ServingConfig
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import collect

REQUESTS = 200


def serve_requests(config: ServingConfig, phase: str) -> None:
    """REQUESTS requests named after `phase`, each answered once."""
    kafka = config.kafka
    uris = {f"{phase}-{i}" for i in range(REQUESTS)}
    features = np.ones(FEATURES, np.float32)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-{phase}"
    ) as outputs:
        inputs.enqueue_batch((uri, {"features": features}) for uri in sorted(uris))
        results = collect(outputs, 0, 120, uris)
        assert outputs.store.duplicates == 0
    assert uris <= results.keys(), f"{len(uris - results.keys())} of {phase}'s requests unanswered"
    assert not [uri for uri in uris if "error" in results[uri]]


def test_a_restart_runs_in_the_same_jvm_and_new_jvm_options_start_a_new_one(write_config, start_job) -> None:
    path, config = write_config()
    job = start_job(path, config)
    serve_requests(config, "first")
    pid, first_job = job.process.pid, job.job_id

    job.restart()
    assert job.process.pid == pid and job.job_id != first_job
    assert job.log_text().count("restarting the job in this JVM") == 1
    assert job.log_text().count("resuming from the retained savepoint") == 1
    serve_requests(config, "in-jvm")

    raw = yaml.safe_load(path.read_text())
    raw["flink"]["jvm_options"] = ["-Xss2m"]
    path.write_text(yaml.safe_dump(raw))
    second_job = job.job_id
    job.restart()
    assert job.process.pid != pid and job.job_id != second_job
    assert "restarting the job in this JVM" not in job.log_text()  # a new process's log
    assert "resuming from the retained savepoint" in job.log_text()
    serve_requests(config, "new-jvm")
