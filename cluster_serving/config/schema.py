"""Loads cluster_serving/config/config.yaml, overlays the user's file, and validates everything once at start-up.

Every later stage receives a `ServingConfig` and can trust it: values have the right types and
ranges, paths are absolute. A bad value stops start-up with one `ConfigError` line that names the
key, instead of a Java stack trace minutes later.

pydantic checks the values the models below declare. The module is longer than the models alone
would be because of two things pydantic does not do: overlaying YAML files, and wording its first
error the way the docs and users' scripts quote it (both bounds of a range, the choices bare).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from annotated_types import Ge, Le
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

DEFAULT_CONFIG_PATH = Path(__file__).with_name("config.yaml")
# The largest Kafka record the project writes or accepts, one figure for every party: the local
# broker (message.max.bytes), the topics the job creates (max.message.bytes, which also holds on a
# broker whose own default is Kafka's 1 MiB), the clients' and the bridge's producers and the job's
# sink (max.request.size). limits.max_instance_bytes may be larger: it also bounds the dense size
# of sparse tensors, which travel smaller than that.
KAFKA_RECORD_BYTES = 20 * 1024 * 1024
# The Flink job's name: the HTTP bridge and the CLI find the running job by it.
JOB_NAME = "cluster-serving"
# What restarts the job from a final savepoint: `cluster-serving restart` sends it to a `start`
# process, which passes it on to its job process, which runs the new job in the same JVM.
RESTART_SIGNAL = signal.SIGUSR1
# An empty flink.checkpoint_interval_ms by kafka.delivery, as Kafka Streams' commit.interval.ms
# (30 s, 100 ms under exactly-once): under at-least-once a checkpoint only bounds what a crash
# serves again, and the requests read while one runs wait longer (docs/benchmarks.md, "Fewer
# checkpoints under at-least-once"); under exactly-once a result is seen one checkpoint later.
CHECKPOINT_INTERVAL_MS = {"at_least_once": 10_000, "exactly_once": 2_000}
# The folder of the job's final savepoints, inside flink.checkpoint_dir (cluster_serving/job/recovery.py).
SAVEPOINTS = "savepoints"
# Mappings whose keys are the user's (property names, input names): a file replaces them whole.
FREE_MAPPINGS = ("properties", "images")


class ConfigError(ValueError):
    """A configuration problem, worded for the person who wrote the file."""


def _config_folder(info: ValidationInfo) -> Path:
    source = (info.context or {}).get("source")
    return source.parent if source else Path.cwd()


def _absolute(value: Any, info: ValidationInfo) -> Path:
    """Relative paths are relative to the config file's folder, not to wherever `start` ran."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string, got {value!r}")
    path = Path(value.strip()).expanduser()
    return path if path.is_absolute() else (_config_folder(info) / path).resolve()


def _none_is(empty: Any) -> BeforeValidator:
    """YAML reads an empty `key:` as None; for these keys that means none."""
    return BeforeValidator(lambda value: empty if value is None else value)


def _as_text(value: Any) -> Any:
    """Kafka takes every property as text; YAML makes numbers and booleans of some."""
    return {str(key): str(item) for key, item in value.items()} if isinstance(value, dict) else value


def _jvm_option(value: Any) -> Any:
    """PyFlink splits the embedded JVM's options at whitespace: one option per item, none inside."""
    if isinstance(value, str) and (not value.startswith("-") or any(char.isspace() for char in value)):
        raise ValueError(f"one JVM option per item, starting with '-' and without spaces, got {value!r}")
    return value


Text = Annotated[str, StringConstraints(strict=True, strip_whitespace=True, min_length=1)]
Texts = Annotated[tuple[Text, ...], _none_is(())]
File = Annotated[Path, BeforeValidator(_absolute)]
# A path that may be left empty (None).
OptionalFile = Annotated[Path | None, BeforeValidator(lambda value, info: _absolute(value, info) if value else None)]
Numbers = Annotated[tuple[StrictFloat, ...], _none_is(())]
JvmOption = Annotated[str, StringConstraints(strict=True), AfterValidator(_jvm_option)]
Dimension = Annotated[StrictInt, Field(ge=1, le=65536)]


class _Section(BaseModel):
    # Frozen: every stage shares the sections, some as cache keys. A key a model lacks is a typo.
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    name: Text
    path: File
    inputs: Texts = ()
    outputs: Texts = ()
    threads: StrictInt = Field(1, ge=0)
    decode_threads: StrictInt = Field(0, ge=0, le=1024)
    float16: StrictBool = False
    cuda_graph: StrictBool = False
    instances: StrictInt = Field(0, ge=0, le=64)
    max_queue_size: StrictInt = Field(0, ge=0)


class KafkaConfig(_Section):
    bootstrap_servers: Text
    input_topic: Text
    result_topic: Text
    # None: <input_topic>.dlq; "": no dead letters.
    dead_letter_topic: Annotated[str, StringConstraints(strict=True, strip_whitespace=True)] | None = None
    group_id: Text
    partitions: StrictInt = Field(ge=1)
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"
    transaction_timeout_ms: StrictInt = Field(600000, ge=1000)
    properties: Annotated[dict[str, str], BeforeValidator(_as_text), _none_is({})] = {}

    @property
    def exactly_once(self) -> bool:
        return self.delivery == "exactly_once"

    @property
    def dead_letters(self) -> str | None:
        """The dead-letter topic, or None when dead letters are off."""
        if self.dead_letter_topic is None:
            return f"{self.input_topic}.dlq"
        return self.dead_letter_topic or None

    @property
    def transactional_id_prefix(self) -> str:
        """Unique per deployment (the group id is), as Kafka transactions require."""
        return f"{self.group_id}-results"


class BatchingConfig(_Section):
    batch_size: StrictInt = Field(ge=1, le=65536)
    max_delay_ms: StrictInt = Field(ge=0, le=60_000)
    run_batch_size: StrictInt = Field(0, ge=0, le=65536)


class FlinkConfig(_Section):
    parallelism: StrictInt = Field(ge=1, le=1024)
    rest_port: StrictInt = Field(ge=0, le=65535)
    checkpoint_interval_ms: StrictInt = Field(ge=100, le=3_600_000)
    checkpoint_dir: File
    restart_attempts: StrictInt = Field(ge=0)
    restart_delay_ms: StrictInt = Field(ge=0)
    # None listed: Flink's Kafka connector from the per-user cache (cluster_serving.jvm).
    jars: Annotated[tuple[File, ...], _none_is(())] = ()
    jvm_options: Annotated[tuple[JvmOption, ...], _none_is(())] = ()
    warm_up_requests: StrictInt = Field(0, ge=0, le=10_000_000)
    jit_after_warm_up: Literal["c1", "c2"] = "c1"

    @property
    def savepoint_dir(self) -> Path:
        """Where a stop's final savepoint goes: the next start resumes from it."""
        return self.checkpoint_dir / SAVEPOINTS


class LimitsConfig(_Section):
    max_instance_bytes: StrictInt = Field(ge=1024)
    max_image_pixels: StrictInt = Field(ge=1)


class ImageConfig(_Section):
    """How one image input is decoded, resized, laid out and normalised."""

    channels: Literal["RGB", "BGR", "L"] = "RGB"
    resize: tuple[Dimension, ...] | None = Field(None, min_length=2, max_length=2, description="[height, width]")
    layout: Literal["HWC", "CHW"] = "HWC"
    dtype: Literal["uint8", "float16", "float32", "float64"] = "uint8"
    scale: StrictFloat = Field(1.0, ge=0)
    mean: Numbers = ()
    std: Numbers = ()

    @model_validator(mode="before")
    @classmethod
    def _float_pixels_in_0_1(cls, data: Any) -> Any:
        """An empty entry takes every default; a float dtype's default scale maps 255 to 1."""
        data = {} if data is None else data
        if isinstance(data, dict) and "scale" not in data:
            return {**data, "scale": 1.0 if data.get("dtype", "uint8") == "uint8" else 1 / 255}
        return data

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _one_per_channel(cls, value: Any, info: ValidationInfo) -> Any:
        depth = 1 if info.data.get("channels") == "L" else 3
        if value not in (None, [], ()) and (not isinstance(value, (list, tuple)) or len(value) != depth):
            raise ValueError(f"must be a list of {depth} numbers (one per channel), got {value!r}")
        return value

    @field_validator("std")
    @classmethod
    def _divisible(cls, std: tuple[float, ...]) -> tuple[float, ...]:
        if 0 in std:
            raise ValueError("must not contain 0")
        return std

    @model_validator(mode="after")
    def _normalised_only_as_floats(self) -> ImageConfig:
        if self.dtype == "uint8" and (self.scale != 1.0 or self.mean or self.std):
            raise ValueError("scale, mean and std need a float dtype")
        return self


class PreprocessConfig(_Section):
    images: Annotated[dict[Text, ImageConfig], _none_is({})] = Field({}, description="a mapping of input name -> settings")


class PostprocessConfig(_Section):
    top_n: StrictInt = Field(0, ge=0, le=65536)


class HttpConfig(_Section):
    host: Text
    port: StrictInt = Field(ge=0, le=65535)
    request_timeout_s: StrictFloat = Field(ge=0.001)
    max_body_bytes: StrictInt = Field(ge=1024)
    max_instances: StrictInt = Field(ge=1)
    rate_limit_per_s: StrictFloat = Field(ge=0)
    rate_limit_burst: StrictInt = Field(ge=0)
    token_env: Annotated[
        str, BeforeValidator(lambda value: value or ""), StringConstraints(strict=True, strip_whitespace=True)
    ] = Field(description="the name of an environment variable")
    flink_rest_url: Annotated[Text, AfterValidator(lambda url: url.rstrip("/"))]
    tls_cert: OptionalFile = None
    tls_key: OptionalFile = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @model_validator(mode="after")
    def _tls_pair(self) -> HttpConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("http.tls_cert and http.tls_key go together: set both, or neither")
        return self

    @field_validator("rate_limit_burst")
    @classmethod
    def _burst_for_rate(cls, burst: int, info: ValidationInfo) -> int:
        if info.data.get("rate_limit_per_s") and not burst:
            raise ValueError("must be >= 1 when http.rate_limit_per_s is set")
        return burst


class ModelsConfig(_Section):
    # Empty: model.path is the repository, a model of one version (cluster_serving/runtime/repository.py).
    repository: OptionalFile = None
    default: Annotated[str, _none_is("")] = ""
    poll_interval_s: StrictFloat = Field(5.0, ge=0)


class ServingConfig(_Section):
    model: ModelConfig
    models: ModelsConfig = ModelsConfig()
    kafka: KafkaConfig
    batching: BatchingConfig
    flink: FlinkConfig
    device: Literal["auto", "cpu", "cuda"]
    limits: LimitsConfig
    http: HttpConfig
    preprocess: PreprocessConfig = PreprocessConfig()
    postprocess: PostprocessConfig = PostprocessConfig()
    # Not a key of the file: where it was read from (None: the defaults alone).
    _source: Path | None = PrivateAttr(None)

    def model_post_init(self, context: Any, /) -> None:
        self._source = (context or {}).get("source")

    @field_validator("flink", mode="before")
    @classmethod
    def _checkpoints_by_kafka(cls, flink: Any, info: ValidationInfo) -> Any:
        """Empty checkpoint_dir: checkpoints/<kafka.group_id> next to the config, one per deployment;
        empty checkpoint_interval_ms: the delivery's (CHECKPOINT_INTERVAL_MS)."""
        kafka = info.data.get("kafka")
        if not isinstance(flink, dict) or not kafka:
            return flink
        derived = {"checkpoint_dir": str(_config_folder(info) / "checkpoints" / kafka.group_id),
                   "checkpoint_interval_ms": CHECKPOINT_INTERVAL_MS[kafka.delivery]}
        return {**flink, **{key: value for key, value in derived.items() if flink.get(key) in (None, "")}}

    @field_validator("http", mode="before")
    @classmethod
    def _embedded_flink_rest(cls, http: Any, info: ValidationInfo) -> Any:
        """Empty flink_rest_url: the embedded cluster's, on flink.rest_port."""
        flink = info.data.get("flink")
        if isinstance(http, dict) and not http.get("flink_rest_url") and flink:
            return {**http, "flink_rest_url": f"http://127.0.0.1:{flink.rest_port}"}
        return http

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def folder(self) -> Path:
        """The config file's folder (the working folder for the defaults): run state goes there."""
        return self.source.parent if self.source else Path.cwd()

    @property
    def flink_log_dir(self) -> Path:
        """Where Flink's own log goes: `log/` next to the config, unless FLINK_LOG_DIR says else."""
        return Path(os.environ.get("FLINK_LOG_DIR", self.folder / "log"))

    def check_files(self) -> None:
        """Fails when the model (without a repository) is missing; separate so `init` can validate first."""
        if self.models.repository is None and not self.model.path.is_file():
            raise ConfigError(f"model.path: model file not found: {self.model.path}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServingConfig:
    """Defaults, then the file at `path`, then `overrides` (dotted keys such as 'kafka.input_topic')."""
    raw = _read_yaml(DEFAULT_CONFIG_PATH)
    if path is not None:
        path = Path(path).resolve()
        _merge(raw, _read_yaml(path))
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for parent in reversed(parents):
            nested = {parent: nested}
        _merge(raw, nested)
    return _validate(raw, path)


@cache
def defaults() -> ServingConfig:
    """cluster_serving/config/config.yaml alone, its paths relative to conf/: for modules that would repeat its values."""
    return _validate(_read_yaml(DEFAULT_CONFIG_PATH), DEFAULT_CONFIG_PATH)


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


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Overlays `update` key by key; unknown keys stay, for the models to refuse by name."""
    for key, value in update.items():
        if isinstance(into.get(key), dict) and isinstance(value, dict) and key not in FREE_MAPPINGS:
            _merge(into[key], value)
        else:
            into[key] = value


def _validate(raw: dict[str, Any], source: Path | None) -> ServingConfig:
    try:
        return ServingConfig.model_validate(raw, context={"source": source})
    except ValidationError as exc:
        raise _one_line(exc) from None


# What a value must be, by pydantic's error type, where the field's description does not say.
MUST_BE = {
    "int_type": "an integer", "float_type": "a number", "string_type": "a non-empty string",
    "string_too_short": "a non-empty string", "tuple_type": "a list of strings", "dict_type": "a mapping",
    "model_type": "a mapping",
}


def _one_line(exc: ValidationError, root: type[BaseModel] | None = None) -> ConfigError:
    """pydantic's first error (a typo before any value) as `dotted.key: problem`.

    pydantic names one bound of a range and quotes the choices; the docs and users' scripts
    match on both bounds and the bare choices, so those come from the declaration. A list index
    is no part of the key (model.inputs, not model.inputs.0)."""
    error = min(exc.errors(), key=lambda item: item["type"] != "extra_forbidden")
    kind, loc, value = error["type"], error["loc"], error.get("input")
    if kind == "extra_forbidden":
        known = ", ".join(sorted(_declared(loc[:-1], root).model_fields))
        return ConfigError(f"{'.'.join(map(str, loc))}: unknown key (known: {known})")
    if not loc:  # a rule across the whole file's keys
        return ConfigError(str(error["ctx"]["error"]) if kind == "value_error" else error["msg"])
    whole = isinstance(loc[-1], str) and loc[-1] != "[key]"  # not one of its items or keys
    if loc[-1] == "[key]":  # the user's key itself is wrong: name the mapping
        loc = loc[:-2]
    keys = [part for part in loc if isinstance(part, str)]
    field = _declared(keys, root)
    declared = list(_declarations(field))
    if kind == "value_error":
        problem = str(error["ctx"]["error"])
    elif kind in ("greater_than_equal", "less_than_equal"):
        low = next(item.ge for item in declared if isinstance(item, Ge))
        high = next((item.le for item in declared if isinstance(item, Le)), None)
        problem = f"must be {f'>= {low}' if high is None else f'between {low} and {high}'}, got {value}"
    elif kind == "literal_error":
        choices = next(get_args(item) for item in declared if get_origin(item) is Literal)
        problem = f"must be one of {', '.join(choices)}, got {value!r}"
    elif wanted := (whole and isinstance(field, FieldInfo) and field.description) or MUST_BE.get(kind):
        problem = f"must be {wanted}, got {value!r}"
    else:
        problem = error["msg"]
    return ConfigError(f"{'.'.join(keys)}: {problem}")


def _declared(keys: Sequence[Any], root: type[BaseModel] | None = None) -> Any:
    """The model class or the field (FieldInfo) that a key path names, from `root` (the config by
    default); under preprocess.images, a key is the user's input name and leads to an ImageConfig."""
    node: Any = root or ServingConfig
    for key in keys:
        node = get_args(node.annotation)[-1] if isinstance(node, FieldInfo) else node.model_fields[key]
        if isinstance(node, FieldInfo) and (section := _section_of(node.annotation)):
            node = section
    return node


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds, an optional one's included (`BatchingConfig | None`)."""
    for candidate in (annotation, *(get_args(annotation) if isinstance(annotation, UnionType) else ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _declarations(node: Any) -> Iterator[Any]:
    """A field's types and constraints, its items' included (a resize dimension's bounds)."""
    if isinstance(node, FieldInfo):
        yield from node.metadata
        node = node.annotation
    yield node
    for arg in get_args(node):
        yield from _declarations(arg)
