"""Loads conf/config.yaml, overlays the user's file, and validates everything once at start-up.

Every later stage receives a `ServingConfig` and can trust it: values have the right types and
ranges, paths are absolute. A bad value stops start-up with one `ConfigError` line that names the
key, instead of a Java stack trace minutes later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG_PATH = Path(__file__).with_name("config.yaml")
PROJECT_ROOT = Path(__file__).resolve().parent.parent
BUILD_JARS = PROJECT_ROOT / "build" / "jars"
# Flink's Kafka connector with kafka-clients inside (shaded), from Maven Central (scripts/setup.sh).
# The largest Kafka record the project writes or accepts, one figure for every party: the local
# broker (message.max.bytes), the topics the job creates (max.message.bytes, which also holds on a
# broker whose own default is Kafka's 1 MiB), the clients' and the bridge's producers and the job's
# sink (max.request.size). limits.max_instance_bytes may be larger: it also bounds the dense size
# of sparse tensors, which travel smaller than that.
KAFKA_RECORD_BYTES = 20 * 1024 * 1024
CONNECTOR_JARS = ("flink-sql-connector-kafka.jar",)
HELPER_JAR = "cluster-serving-flink.jar"
DEVICES = ("auto", "cpu", "cuda")
DELIVERIES = ("at_least_once", "exactly_once")
IMAGE_CHANNELS = ("RGB", "BGR", "L")
IMAGE_LAYOUTS = ("HWC", "CHW")
IMAGE_DTYPES = ("uint8", "float16", "float32", "float64")
# The Flink job's name: the HTTP bridge and the CLI find the running job by it.
JOB_NAME = "cluster-serving"


# Mappings whose keys are the user's (property names, input names), not known in advance.
FREE_MAPPINGS = ("properties", "images")


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the file."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    threads: int = 1


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap_servers: str
    input_topic: str
    result_topic: str
    group_id: str
    partitions: int
    delivery: str = "at_least_once"
    transaction_timeout_ms: int = 600000
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def exactly_once(self) -> bool:
        return self.delivery == "exactly_once"

    @property
    def transactional_id_prefix(self) -> str:
        """Unique per deployment (the group id is), as Kafka transactions require."""
        return f"{self.group_id}-results"


@dataclass(frozen=True)
class BatchingConfig:
    batch_size: int
    max_delay_ms: int


@dataclass(frozen=True)
class FlinkConfig:
    parallelism: int
    rest_port: int
    checkpoint_interval_ms: int
    checkpoint_dir: Path
    restart_attempts: int
    restart_delay_ms: int
    jars: tuple[Path, ...]

    @property
    def pipeline_jars(self) -> list[Path]:
        """The connector jars plus the project's helper jar (key/value Kafka schemas)."""
        return [*self.jars, BUILD_JARS / HELPER_JAR]


@dataclass(frozen=True)
class LimitsConfig:
    max_instance_bytes: int
    max_image_pixels: int


@dataclass(frozen=True)
class ImageConfig:
    """How one image input is decoded, resized, laid out and normalised."""

    channels: str = "RGB"
    resize: tuple[int, int] | None = None  # (height, width)
    layout: str = "HWC"
    dtype: str = "uint8"
    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()


@dataclass(frozen=True)
class PreprocessConfig:
    images: dict[str, ImageConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class PostprocessConfig:
    top_n: int = 0


@dataclass(frozen=True)
class TestingConfig:
    fail_inference_at_batch: int = 0


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int
    request_timeout_s: float
    max_body_bytes: int
    max_instances: int
    rate_limit_per_s: float
    rate_limit_burst: int
    token_env: str
    flink_rest_url: str


@dataclass(frozen=True)
class ServingConfig:
    model: ModelConfig
    kafka: KafkaConfig
    batching: BatchingConfig
    flink: FlinkConfig
    device: str
    limits: LimitsConfig
    http: HttpConfig
    preprocess: PreprocessConfig = PreprocessConfig()
    postprocess: PostprocessConfig = PostprocessConfig()
    testing: TestingConfig = TestingConfig()
    source: Path | None = None

    @property
    def folder(self) -> Path:
        """The config file's folder (the working folder for the defaults): run state goes there."""
        return self.source.parent if self.source else Path.cwd()

    @property
    def flink_log_dir(self) -> Path:
        """Where Flink's own log goes: `log/` next to the config, unless FLINK_LOG_DIR says else."""
        return Path(os.environ.get("FLINK_LOG_DIR", self.folder / "log"))

    def check_files(self) -> None:
        """Fails when the model or a jar is missing; separate so `init` can validate first."""
        if not self.model.path.is_file():
            raise ConfigError(f"model.path: model file not found: {self.model.path}")
        for jar in self.flink.pipeline_jars:
            if not jar.is_file():
                raise ConfigError(
                    f"flink.jars: jar not found: {jar} (run scripts/setup.sh, or list your "
                    "own flink-sql-connector-kafka jar in flink.jars)"
                )


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServingConfig:
    """Defaults, then the file at `path`, then `overrides` (dotted keys such as 'kafka.input_topic')."""
    raw = _read_yaml(DEFAULT_CONFIG_PATH)
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path).resolve()
        _merge(raw, _read_yaml(path), prefix="")
        base_dir = path.parent
    for dotted, value in (overrides or {}).items():
        _merge(raw, _nest(dotted, value), prefix="")
    return _build(raw, base_dir, path)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    *parents, leaf = dotted.split(".")
    nested: dict[str, Any] = {leaf: value}
    for parent in reversed(parents):
        nested = {parent: nested}
    return nested


def _merge(into: dict[str, Any], update: dict[str, Any], prefix: str) -> None:
    """Overlays `update` on the defaults; unknown keys are refused so typos do not pass silently."""
    for key, value in update.items():
        name = f"{prefix}{key}"
        if key not in into:
            raise ConfigError(f"{name}: unknown key (known: {', '.join(sorted(into))})")
        if isinstance(into[key], dict) and key not in FREE_MAPPINGS:
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: must be a mapping")
            _merge(into[key], value, prefix=f"{name}.")
        else:
            into[key] = value


def _build(raw: dict[str, Any], base_dir: Path, source: Path | None) -> ServingConfig:
    model, kafka, batching, flink = raw["model"], raw["kafka"], raw["batching"], raw["flink"]
    jars = _string_list(flink["jars"], "flink.jars") or [str(BUILD_JARS / jar) for jar in CONNECTOR_JARS]
    device = raw["device"]
    if device not in DEVICES:
        raise ConfigError(f"device: must be one of {', '.join(DEVICES)}, got {device!r}")
    return ServingConfig(
        model=ModelConfig(
            name=_text(model["name"], "model.name"),
            path=_path(model["path"], "model.path", base_dir),
            inputs=tuple(_string_list(model["inputs"], "model.inputs")),
            outputs=tuple(_string_list(model["outputs"], "model.outputs")),
            threads=_int(model["threads"], "model.threads", low=0),
        ),
        kafka=KafkaConfig(
            bootstrap_servers=_text(kafka["bootstrap_servers"], "kafka.bootstrap_servers"),
            input_topic=_text(kafka["input_topic"], "kafka.input_topic"),
            result_topic=_text(kafka["result_topic"], "kafka.result_topic"),
            group_id=_text(kafka["group_id"], "kafka.group_id"),
            partitions=_int(kafka["partitions"], "kafka.partitions", low=1),
            delivery=_choice(kafka["delivery"], "kafka.delivery", DELIVERIES),
            transaction_timeout_ms=_int(
                kafka["transaction_timeout_ms"], "kafka.transaction_timeout_ms", low=1000
            ),
            properties=_properties(kafka["properties"]),
        ),
        batching=BatchingConfig(
            batch_size=_int(batching["batch_size"], "batching.batch_size", low=1, high=65536),
            max_delay_ms=_int(batching["max_delay_ms"], "batching.max_delay_ms", low=0, high=60_000),
        ),
        flink=FlinkConfig(
            parallelism=_int(flink["parallelism"], "flink.parallelism", low=1, high=1024),
            rest_port=_int(flink["rest_port"], "flink.rest_port", low=0, high=65535),
            checkpoint_interval_ms=_int(
                flink["checkpoint_interval_ms"], "flink.checkpoint_interval_ms", low=100
            ),
            checkpoint_dir=_path(flink["checkpoint_dir"], "flink.checkpoint_dir", base_dir)
            if flink["checkpoint_dir"]
            else base_dir / "checkpoints" / _text(kafka["group_id"], "kafka.group_id"),
            restart_attempts=_int(flink["restart_attempts"], "flink.restart_attempts", low=0),
            restart_delay_ms=_int(flink["restart_delay_ms"], "flink.restart_delay_ms", low=0),
            jars=tuple(_path(jar, "flink.jars", base_dir) for jar in jars),
        ),
        device=device,
        limits=LimitsConfig(
            max_instance_bytes=_int(
                raw["limits"]["max_instance_bytes"], "limits.max_instance_bytes", low=1024
            ),
            max_image_pixels=_int(raw["limits"]["max_image_pixels"], "limits.max_image_pixels", low=1),
        ),
        http=_http(raw["http"], flink["rest_port"]),
        preprocess=PreprocessConfig(images=_images(raw["preprocess"]["images"])),
        postprocess=PostprocessConfig(
            top_n=_int(raw["postprocess"]["top_n"], "postprocess.top_n", low=0, high=65536)
        ),
        testing=TestingConfig(
            fail_inference_at_batch=_int(
                raw["testing"]["fail_inference_at_batch"], "testing.fail_inference_at_batch", low=0
            )
        ),
        source=source,
    )


def _images(value: Any) -> dict[str, ImageConfig]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"preprocess.images: must be a mapping of input name -> settings, got {value!r}")
    return {_text(name, "preprocess.images"): _image(f"preprocess.images.{name}", item or {}) for name, item in value.items()}


def _image(name: str, value: Any) -> ImageConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: must be a mapping, got {value!r}")
    known = ImageConfig.__dataclass_fields__
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown key (known: {', '.join(known)})")
    channels = _choice(value.get("channels", "RGB"), f"{name}.channels", IMAGE_CHANNELS)
    dtype = _choice(value.get("dtype", "uint8"), f"{name}.dtype", IMAGE_DTYPES)
    resize = value.get("resize")
    if resize is not None:
        if not isinstance(resize, list) or len(resize) != 2:
            raise ConfigError(f"{name}.resize: must be [height, width], got {resize!r}")
        resize = tuple(_int(dim, f"{name}.resize", low=1, high=65536) for dim in resize)
    default_scale = 1.0 if dtype == "uint8" else 1 / 255
    scale = _number(value.get("scale", default_scale), f"{name}.scale", low=0)
    if dtype == "uint8" and (scale != 1.0 or "mean" in value or "std" in value):
        raise ConfigError(f"{name}: scale, mean and std need a float dtype")
    depth = 1 if channels == "L" else 3
    mean = _per_channel(value.get("mean"), f"{name}.mean", depth)
    std = _per_channel(value.get("std"), f"{name}.std", depth)
    if any(item == 0 for item in std):
        raise ConfigError(f"{name}.std: must not contain 0")
    layout = _choice(value.get("layout", "HWC"), f"{name}.layout", IMAGE_LAYOUTS)
    return ImageConfig(channels, resize, layout, dtype, scale, mean, std)


def _choice(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _per_channel(value: Any, name: str, depth: int) -> tuple[float, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) != depth:
        raise ConfigError(f"{name}: must be a list of {depth} numbers (one per channel), got {value!r}")
    return tuple(_number(item, name, low=float("-inf")) for item in value)


def _http(http: dict[str, Any], flink_rest_port: int) -> HttpConfig:
    rate = _number(http["rate_limit_per_s"], "http.rate_limit_per_s", low=0)
    burst = _int(http["rate_limit_burst"], "http.rate_limit_burst", low=0)
    if rate and not burst:
        raise ConfigError("http.rate_limit_burst: must be >= 1 when http.rate_limit_per_s is set")
    token_env = http["token_env"] or ""
    if not isinstance(token_env, str):
        raise ConfigError(f"http.token_env: must be the name of an environment variable, got {token_env!r}")
    return HttpConfig(
        host=_text(http["host"], "http.host"),
        port=_int(http["port"], "http.port", low=0, high=65535),
        request_timeout_s=_number(http["request_timeout_s"], "http.request_timeout_s", low=0.001),
        max_body_bytes=_int(http["max_body_bytes"], "http.max_body_bytes", low=1024),
        max_instances=_int(http["max_instances"], "http.max_instances", low=1),
        rate_limit_per_s=rate,
        rate_limit_burst=burst,
        token_env=token_env.strip(),
        flink_rest_url=(http["flink_rest_url"] or f"http://127.0.0.1:{flink_rest_port}").rstrip("/"),
    )


def _number(value: Any, name: str, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: must be a number, got {value!r}")
    if value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value}")
    return float(value)


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}: must be {bound}, got {value}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: must be a non-empty string, got {value!r}")
    return value.strip()


def _string_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{name}: must be a list of strings, got {value!r}")
    return [_text(item, name) for item in value]


def _path(value: Any, name: str, base_dir: Path) -> Path:
    path = Path(_text(value, name)).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def _properties(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"kafka.properties: must be a mapping, got {value!r}")
    return {str(key): str(item) for key, item in value.items()}
