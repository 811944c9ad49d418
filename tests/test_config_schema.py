"""The typed configuration: pydantic's errors worded as users quote them, the values derived from
other keys, and the properties other modules rely on (immutable, hashable, picklable)."""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import pytest
import yaml

from cluster_serving.config import DEFAULT_CONFIG_PATH, ConfigError, ImageConfig, ServingConfig, defaults, load_config

IMAGES = "preprocess.images"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"flink.rest_port": 70000}, "flink.rest_port: must be between 0 and 65535, got 70000"),
        ({"flink.checkpoint_interval_ms": 50}, "flink.checkpoint_interval_ms: must be between 100 and 3600000, got 50"),
        ({"flink.warm_up_requests": -1}, "flink.warm_up_requests: must be between 0 and 10000000, got -1"),
        ({"flink.jit_after_warm_up": "c3"}, "flink.jit_after_warm_up: must be one of c1, c2, got 'c3'"),
        ({"kafka.partitions": 0}, "kafka.partitions: must be >= 1, got 0"),
        ({"http.request_timeout_s": 0}, "http.request_timeout_s: must be >= 0.001, got 0"),
        ({"http.rate_limit_per_s": True}, "http.rate_limit_per_s: must be a number, got True"),
        ({"kafka.delivery": "once"}, "kafka.delivery: must be one of at_least_once, exactly_once, got 'once'"),
        ({"model.inputs": "x"}, "model.inputs: must be a list of strings, got 'x'"),
        ({"model.inputs": ["x", " "]}, "model.inputs: must be a non-empty string, got ' '"),
        ({"model.path": ""}, "model.path: must be a non-empty string, got ''"),
        ({"kafka.properties": [1]}, "kafka.properties: must be a mapping, got [1]"),
        ({"http.token_env": 5}, "http.token_env: must be the name of an environment variable, got 5"),
        ({"http.rate_limit_per_s": 1}, "http.rate_limit_burst: must be >= 1 when http.rate_limit_per_s is set"),
        ({"flink.jvm_options": ["-Xmx1g -Xms1g"]},
         "flink.jvm_options: one JVM option per item, starting with '-' and without spaces, got '-Xmx1g -Xms1g'"),
        ({"flink.jvm_options": ["Xmx1g"]},
         "flink.jvm_options: one JVM option per item, starting with '-' and without spaces, got 'Xmx1g'"),
        ({IMAGES: 5}, "preprocess.images: must be a mapping of input name -> settings, got 5"),
        ({IMAGES: {1: {}}}, "preprocess.images: must be a non-empty string, got 1"),
        ({IMAGES: {"a": 5}}, "preprocess.images.a: must be a mapping, got 5"),
        ({IMAGES: {"a": {"resize": [3]}}}, "preprocess.images.a.resize: must be [height, width], got [3]"),
        ({IMAGES: {"a": {"resize": [3, "x"]}}}, "preprocess.images.a.resize: must be an integer, got 'x'"),
        ({IMAGES: {"a": {"resize": [3, 0]}}}, "preprocess.images.a.resize: must be between 1 and 65536, got 0"),
        ({IMAGES: {"a": {"dtype": "float32", "channels": "L", "mean": [1, 2, 3]}}},
         "preprocess.images.a.mean: must be a list of 1 numbers (one per channel), got [1, 2, 3]"),
        ({IMAGES: {"a": {"dtype": "float32", "std": [1, 0, 1]}}}, "preprocess.images.a.std: must not contain 0"),
        ({IMAGES: {"a": {"mean": [1, 2, 3]}}}, "preprocess.images.a: scale, mean and std need a float dtype"),
    ],
)
def test_messages_name_the_key_in_the_users_terms(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # A typo is named before any bad value, wherever it is.
        ({"batching.batch_size": 0, "kafka.topic": "x"}, "kafka.topic: unknown key (known: bootstrap_servers, "
         "dead_letter_topic, delivery, group_id, input_topic, partitions, properties, result_topic, transaction_timeout_ms)"),
        ({"testing.fail_inference_at_batch": 1}, "testing: unknown key (known: batching, device, flink, http, "
         "kafka, limits, model, models, postprocess, preprocess)"),
        ({"source": "elsewhere.yaml"}, "source: unknown key"),
        ({IMAGES: {"a": {"colour": "RGB"}}}, "preprocess.images.a.colour: unknown key (known: channels, dtype,"),
    ],
)
def test_unknown_keys_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^[^\n]*$") as error:
        load_config(overrides=overrides)
    assert str(error.value).startswith(message)


def test_values_derived_from_other_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"kafka": {"group_id": " blue ", "properties": None}, "flink": {"rest_port": 9091},
                                    "model": {"path": "models/m.onnx"}, "http": {"token_env": " TOKEN "}}))
    config = load_config(path, {"kafka.properties": {"retries": 5, "enable.idempotence": True}})
    assert config.source == path and config.folder == tmp_path
    assert config.model.path == tmp_path / "models" / "m.onnx"
    assert config.flink.checkpoint_dir == tmp_path / "checkpoints" / "blue"
    assert config.http.flink_rest_url == "http://127.0.0.1:9091"
    assert config.http.token_env == "TOKEN"
    assert config.kafka.properties == {"retries": "5", "enable.idempotence": "True"}
    assert config.kafka.transactional_id_prefix == "blue-results" and not config.kafka.exactly_once
    explicit = load_config(path, {"http.flink_rest_url": "http://flink:8081/", "flink.checkpoint_dir": "cp"})
    assert explicit.http.flink_rest_url == "http://flink:8081"
    assert explicit.flink.checkpoint_dir == tmp_path / "cp"


def test_the_checkpoint_interval_follows_the_delivery_unless_given() -> None:
    assert defaults().flink.checkpoint_interval_ms == 10_000
    assert load_config(overrides={"kafka.delivery": "exactly_once"}).flink.checkpoint_interval_ms == 2_000
    given = {"flink.checkpoint_interval_ms": 500}
    assert load_config(overrides=given).flink.checkpoint_interval_ms == 500
    assert load_config(overrides={**given, "kafka.delivery": "exactly_once"}).flink.checkpoint_interval_ms == 500


def test_image_defaults_follow_the_dtype() -> None:
    config = load_config(overrides={IMAGES: {"a": None, "b": {"dtype": "float16", "resize": [2, 3]}}})
    assert config.preprocess.images["a"] == ImageConfig()
    assert config.preprocess.images["a"].scale == 1.0
    assert config.preprocess.images["b"].scale == pytest.approx(1 / 255)
    assert config.preprocess.images["b"].resize == (2, 3)


def test_defaults_are_the_shipped_file_alone() -> None:
    assert defaults() is defaults()
    assert defaults() == load_config(DEFAULT_CONFIG_PATH)
    assert defaults().source == DEFAULT_CONFIG_PATH
    assert defaults().model.path == DEFAULT_CONFIG_PATH.parent / "model.onnx"


def test_sections_are_immutable_hashable_and_picklable() -> None:
    config = load_config()
    with pytest.raises(ValueError):
        config.batching.batch_size = 1  # type: ignore[misc]
    cached = functools.lru_cache(maxsize=None)(lambda section: object())
    for section in (config.model, config.batching, config.flink, config.limits, config.http, ImageConfig()):
        assert cached(section) is cached(type(section).model_validate(section.model_dump()))
    copy = pickle.loads(pickle.dumps(config))  # PyFlink ships the sections to its workers
    assert isinstance(copy, ServingConfig) and copy == config and copy.source == config.source


@pytest.mark.parametrize(("value", "topic"), [(None, "serving_stream.dlq"), ("", None), (" failed ", "failed")])
def test_the_dead_letter_topic(value: str | None, topic: str | None) -> None:
    overrides = {} if value is None else {"kafka.dead_letter_topic": value}
    assert load_config(overrides=overrides).kafka.dead_letters == topic
