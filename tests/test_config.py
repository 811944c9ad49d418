"""Configuration: validation messages, and the three start-up errors a user meets first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster_serving.config import ConfigError, load_config
from cluster_serving.jvm import pipeline_jars
from cluster_serving.ops.processes import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_complete_and_valid() -> None:
    config = load_config()
    assert config.batching.batch_size == 32
    assert config.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert config.device == "auto"
    assert config.flink.jars == ()
    connector, helper = pipeline_jars(config.flink)  # from the per-user cache, made on first use
    assert connector.name == "flink-sql-connector-kafka-5.0.0-2.2.jar" and connector.is_file()
    assert helper.name.startswith("cluster-serving-flink-") and helper.is_file()


def test_relative_paths_follow_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m.onnx"}}))
    assert load_config(path).model.path == tmp_path / "m.onnx"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"batching.batch_size": 0}, "batching.batch_size: must be between 1 and 65536, got 0"),
        ({"batching.max_delay_ms": "soon"}, "batching.max_delay_ms: must be an integer, got 'soon'"),
        ({"batching.run_batch_size": -1}, "batching.run_batch_size: must be between 0 and 65536, got -1"),
        ({"device": "tpu"}, "device: must be one of auto, cpu, cuda, got 'tpu'"),
        ({"kafka.input_topic": ""}, "kafka.input_topic: must be a non-empty string"),
        ({"kafka.topic": "x"}, "kafka.topic: unknown key"),
        ({"flink.parallelism": True}, "flink.parallelism: must be an integer, got True"),
    ],
)
def test_invalid_values_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert str(error.value).startswith(message)


def run_job(config: dict, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "cluster_serving.job.main", "--config", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


def test_missing_model_file(tmp_path: Path) -> None:
    result = run_job({"model": {"path": "nowhere.onnx"}}, tmp_path)
    assert_one_line_error(result, f"model.path: model file not found: {tmp_path / 'nowhere.onnx'}")


def test_invalid_value(tmp_path: Path, sample_model: Path) -> None:
    result = run_job({"model": {"path": str(sample_model)}, "batching": {"batch_size": -1}}, tmp_path)
    assert_one_line_error(result, "batching.batch_size: must be between 1 and 65536, got -1")


def test_unreachable_broker(tmp_path: Path, sample_model: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = run_job({"model": {"path": str(sample_model)}, "kafka": {"bootstrap_servers": address}}, tmp_path)
    assert_one_line_error(result, f"kafka.bootstrap_servers: no Kafka broker reachable at {address}")


def test_unloadable_model(tmp_path: Path) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"this is not a protobuf")
    result = run_job({"model": {"path": "broken.onnx"}}, tmp_path)
    assert_one_line_error(result, f"cannot load model {tmp_path / 'broken.onnx'}")


def test_model_inputs_that_do_not_match_the_config(tmp_path: Path, sample_model: Path) -> None:
    result = run_job({"model": {"path": str(sample_model), "inputs": ["pixels"]}}, tmp_path)
    assert_one_line_error(result, "model.inputs ['pixels'] do not match the model's inputs ['features']")


def test_image_settings_for_an_input_the_model_lacks(tmp_path: Path, sample_model: Path) -> None:
    config = {"model": {"path": str(sample_model)},
              "preprocess": {"images": {"photo": {"layout": "CHW"}}}}
    assert_one_line_error(run_job(config, tmp_path), "preprocess.images.photo: the model has no input 'photo'")


def test_missing_connector_jar(tmp_path: Path, sample_model: Path) -> None:
    result = run_job({"model": {"path": str(sample_model)}, "flink": {"jars": ["/nowhere/flink-sql-connector-kafka.jar"]}}, tmp_path)
    assert_one_line_error(result, "flink.jars: jar not found: /nowhere/flink-sql-connector-kafka.jar")
