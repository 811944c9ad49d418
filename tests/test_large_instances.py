"""Large instances on the real broker: a request of 10 MiB and its 10 MiB result pass every size
limit on the way (the client's producer, the topics, the job's source and sink, the reader) and a
small request sent right after is not held up behind them. One too large for a Kafka record gets
the client's clear refusal, and one just over limits.max_instance_bytes an error result."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import KAFKA_RECORD_BYTES, ServingConfig, load_config
from cluster_serving.ops.processes import write_run_config
from tests.onnx_models import graph_model

VALUES = 10 * 2**20 // 4  # float32 values of one 10 MiB instance
MAX_INSTANCE_BYTES = 12 * 2**20


def identity_model(path: Path) -> Path:
    """y = x for a [VALUES] float32 input: the result is as large as the request."""
    return graph_model(path, [("x", TensorProto.FLOAT, [VALUES])], [helper.make_node("Identity", ["x"], ["y"])],
                       [("y", TensorProto.FLOAT, [VALUES])])


@pytest.fixture
def large_config(broker, tmp_path: Path) -> tuple[Path, ServingConfig]:
    model = identity_model(tmp_path / "identity.onnx")
    path = write_run_config(tmp_path, model, broker.bootstrap_servers, limits={"max_instance_bytes": MAX_INSTANCE_BYTES},
                            flink={"checkpoint_interval_ms": 1000})
    return path, load_config(path)


def test_ten_mib_requests_and_results_pass_and_do_not_hold_up_others(large_config, start_job) -> None:
    path, config = large_config
    start_job(path, config)
    kafka = config.kafka
    big = np.random.default_rng(7).normal(size=VALUES).astype(np.float32)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        inputs.enqueue("big-0", x=big)
        inputs.enqueue("big-1", x=big[::-1].copy())
        inputs.enqueue("too-big", x=np.zeros(MAX_INSTANCE_BYTES // 4 + 1024, np.float32))
        inputs.flush()
        sent_small = time.monotonic()
        inputs.enqueue("small", x=np.ones(16, np.float32))  # answered with an error: the model wants VALUES
        inputs.flush()
        small = outputs.query("small", timeout=120)
        small_wait = time.monotonic() - sent_small
        with pytest.raises(ValueError, match="over Kafka's record limit"):
            inputs.enqueue("over-the-record-limit", x=np.zeros(KAFKA_RECORD_BYTES // 4 + 1, np.float32))
        results = {uri: outputs.query(uri, timeout=120) for uri in ("big-0", "big-1", "too-big")}

    print(json.dumps({"seconds from sending a small request behind three large ones to its answer": round(small_wait, 2)}))
    assert small is not None and small["error"].startswith("invalid input: input 'x': shape"), small
    np.testing.assert_array_equal(results["big-0"]["y"], big)
    np.testing.assert_array_equal(results["big-1"]["y"], big[::-1])
    assert results["too-big"]["error"].startswith("bad request: message of"), results["too-big"]
