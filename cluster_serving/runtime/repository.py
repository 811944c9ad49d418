"""The model repository: what may be served, read from disk, and the routing table the job serves by.

Laid out as Triton and MindSpore Serving users know it:

    DIR/<name>/<version>/model.onnx    versions are positive integers
    DIR/<name>/servable.yaml           optional: ServableConfig below
    DIR/<name>/servable.py             optional: the stage functions servable.yaml names

A pipeline is a servable.yaml of `kind: pipeline` with no version folders, served as version 1.
Without `models.repository`, `model.path` is a repository of one (model.name, version 1) whose
settings are the config's own. Scanning only reads folders and YAML (no ONNX Runtime), so every
room can afford it: the job's poller, the bridge's model list, the CLI's checks.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, StrictBool, StrictInt, ValidationError, model_validator

from cluster_serving.config.schema import (
    BatchingConfig,
    ConfigError,
    PostprocessConfig,
    PreprocessConfig,
    ServingConfig,
    Text,
    Texts,
    _none_is,
    _one_line,
    _Section,
)
from cluster_serving.wire.codec import MODEL_NAME

MODEL_FILE = "model.onnx"
SERVABLE_FILE = "servable.yaml"
STAGES_FILE = "servable.py"
PIPELINE_VERSION = 1


def _policy(value: Any) -> Any:
    """`all` is a bare word in YAML; the other policies are one-key mappings."""
    return {"all": True} if value == "all" else value


class VersionPolicy(_Section):
    """Which versions are served (MindSpore's and Triton's version policies): the newest `latest`,
    the `specific` ones, or `all`; a request naming no version gets the newest served."""

    latest: StrictInt | None = Field(None, ge=1)
    specific: tuple[StrictInt, ...] = ()
    all: StrictBool = False

    @model_validator(mode="after")
    def _one_policy(self) -> VersionPolicy:
        if sum((self.latest is not None, bool(self.specific), self.all)) > 1:
            raise ValueError("must be one of {latest: N}, {specific: [versions]} or all")
        return self

    def served(self, versions: list[int]) -> tuple[int, ...]:
        versions = sorted(versions)
        if self.all:
            return tuple(versions)
        if self.specific:
            return tuple(version for version in versions if version in self.specific)
        return tuple(versions[-(self.latest or 1):])


class Stage(_Section):
    # The name of a function in the servable's servable.py; empty: none.
    function: Annotated[str, _none_is("")] = ""
    # false: called once per instance with a dict of arrays; true: once per batch with a list of them.
    batched: StrictBool = False


class ServablePreprocess(PreprocessConfig, Stage):
    pass


class ServablePostprocess(PostprocessConfig, Stage):
    pass


class PipelineStep(_Section):
    model: Text
    # Empty: the step's model name. Later steps refer to this step's outputs as "<name>.<output>".
    name: Annotated[str, _none_is("")] = ""
    # Empty: the newest version the model serves.
    version: StrictInt | None = Field(None, ge=1)
    # The step model's input name -> a request input's name, or "<earlier step>.<output>". Empty:
    # the first step takes the request's inputs as they are, later ones the previous step's outputs.
    inputs: Annotated[dict[Text, Text], _none_is({})] = {}

    @property
    def step_name(self) -> str:
        return self.name or self.model


class ServableConfig(_Section):
    kind: Literal["model", "pipeline"] = "model"
    inputs: Texts = ()
    outputs: Texts = ()
    # Empty: the config's `batching`.
    batching: BatchingConfig | None = None
    version_policy: Annotated[VersionPolicy, BeforeValidator(_policy)] = VersionPolicy()
    preprocess: ServablePreprocess = ServablePreprocess()
    postprocess: ServablePostprocess = ServablePostprocess()
    steps: tuple[PipelineStep, ...] = ()
    # Defaults: the config's model.instances and model.max_queue_size.
    instances: StrictInt = Field(0, ge=0, le=64)
    max_queue_size: StrictInt = Field(0, ge=0)

    @model_validator(mode="after")
    def _steps_for_pipelines(self) -> ServableConfig:
        if (self.kind == "pipeline") != bool(self.steps):
            raise ValueError("a pipeline lists its steps, and only a pipeline has steps")
        names = [step.step_name for step in self.steps]
        if len(set(names)) != len(names):
            raise ValueError("steps: two steps share a name; give one a `name`")
        return self


@dataclass(frozen=True)
class Servable:
    name: str
    folder: Path
    config: ServableConfig
    versions: tuple[int, ...]  # the ones its version policy serves, ascending
    batching: BatchingConfig
    # The file of every version in its folder (pipelines: none).
    files: dict[int, Path] = field(default_factory=dict, compare=False)

    def served(self, left_out: frozenset[tuple[str, int]]) -> tuple[int, ...]:
        """The versions the policy serves once those in `left_out` (failed to open) are set aside:
        with `latest: 1`, a broken version 3 leaves version 2 serving."""
        if self.is_pipeline:
            return self.versions
        return self.config.version_policy.served([version for version in self.files if (self.name, version) not in left_out])

    @property
    def is_pipeline(self) -> bool:
        return self.config.kind == "pipeline"

    def path(self, version: int) -> Path:
        return self.files[version]

    @property
    def stages_file(self) -> Path:
        return self.folder / STAGES_FILE


@dataclass(frozen=True)
class Repository:
    servables: dict[str, Servable]
    default: str
    # Models left out of this reading, and why (a broken servable.yaml, a pipeline step naming
    # nothing): fatal at start, reported by the poller while the model's last good reading serves.
    problems: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(sorted(self.servables)) or "nothing"


def scan(config: ServingConfig) -> Repository:
    """The repository as it is on disk now."""
    folder = config.models.repository
    if folder is None:
        return Repository({config.model.name: _single_model(config)}, config.model.name)
    if not folder.is_dir():
        raise ConfigError(f"models.repository: not a folder: {folder}")
    servables: dict[str, Servable] = {}
    problems: dict[str, str] = {}
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir() or not MODEL_NAME.fullmatch(entry.name):
            continue
        try:
            servables[entry.name] = _servable(entry, config)
        except ConfigError as exc:
            problems[entry.name] = str(exc)
    for name, servable in list(servables.items()):
        problem = _pipeline_problem(servable, servables)
        if problem:
            problems[name] = problem
            del servables[name]
    return Repository(servables, _default(config, servables), problems)


def rescan(config: ServingConfig, previous: Repository) -> Repository:
    """scan(), where a model whose reading now fails (a servable.yaml being edited) keeps its
    `previous` reading, its problem still listed: what the running job's poller and the bridge
    serve meanwhile. ConfigError when the folder itself is gone."""
    repository = scan(config)
    kept = {name: previous.servables[name] for name in repository.problems if name in previous.servables}
    return Repository({**repository.servables, **kept}, repository.default, repository.problems)


def checked_scan(config: ServingConfig) -> Repository:
    """scan(), refusing a repository with problems or nothing to serve: what starting needs."""
    repository = scan(config)
    if repository.problems:
        name, problem = next(iter(sorted(repository.problems.items())))
        raise ConfigError(f"models.repository: {problem}")
    if not repository.servables:
        raise ConfigError(f"models.repository: no model in {config.models.repository} (expected <name>/<version>/{MODEL_FILE})")
    if repository.default not in repository.servables:
        raise ConfigError(f"models.default: no model {repository.default!r}; the repository serves {repository.describe()}")
    for servable in repository.servables.values():
        if not servable.versions:
            raise ConfigError(f"models.repository: model {servable.name!r} has no version to serve in {servable.folder}")
    return repository


def _single_model(config: ServingConfig) -> Servable:
    servable = ServableConfig(
        inputs=config.model.inputs, outputs=config.model.outputs, batching=config.batching,
        preprocess=ServablePreprocess(images=config.preprocess.images),
        postprocess=ServablePostprocess(top_n=config.postprocess.top_n),
        instances=config.model.instances, max_queue_size=config.model.max_queue_size,
    )
    return Servable(config.model.name, config.model.path.parent, servable, (1,), config.batching, {1: config.model.path})


def _servable(folder: Path, config: ServingConfig) -> Servable:
    servable = _read_servable(folder / SERVABLE_FILE, config)
    if servable.kind == "pipeline":
        return Servable(folder.name, folder, servable, (PIPELINE_VERSION,), servable.batching or config.batching)
    files = {
        int(entry.name): entry / MODEL_FILE
        for entry in folder.iterdir()
        if entry.name.isdigit() and int(entry.name) > 0 and (entry / MODEL_FILE).is_file()
    }
    served = servable.version_policy.served(list(files))
    return Servable(folder.name, folder, servable, served, servable.batching or config.batching, files)


def _read_servable(path: Path, config: ServingConfig) -> ServableConfig:
    """servable.yaml, or the config's own settings when there is none."""
    defaults = {
        "batching": config.batching.model_dump(),
        "preprocess": {"images": {name: image.model_dump() for name, image in config.preprocess.images.items()}},
        "postprocess": {"top_n": config.postprocess.top_n},
        "instances": config.model.instances,
        "max_queue_size": config.model.max_queue_size,
    }
    if not path.is_file():
        return ServableConfig.model_validate(defaults)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not readable YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping")
    for section, default in defaults.items():  # a section the file has overlays the config's
        data[section] = {**default, **data[section]} if isinstance(data.get(section), dict) else data.get(section, default)
    try:
        return ServableConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_one_line(exc, ServableConfig)}") from None


def _pipeline_problem(servable: Servable, servables: dict[str, Servable]) -> str | None:
    """Whether a pipeline's steps name models the repository serves, and refer only to earlier steps."""
    earlier: set[str] = set()
    for step in servable.config.steps:
        model = servables.get(step.model)
        where = f"{servable.folder / SERVABLE_FILE}: step {step.step_name!r}"
        if model is None or model.is_pipeline:
            return f"{where}: no model {step.model!r} in the repository"
        if step.version is not None and step.version not in model.versions:
            return f"{where}: model {step.model!r} serves no version {step.version}"
        for source in step.inputs.values():
            if "." in source and source.split(".", 1)[0] not in earlier:
                return f"{where}: input {source!r} names no earlier step"
        earlier.add(step.step_name)
    return None


def _default(config: ServingConfig, servables: dict[str, Servable]) -> str:
    if config.models.default:
        return config.models.default
    if len(servables) == 1:
        return next(iter(servables))
    return config.model.name


@dataclass(frozen=True)
class TableEntry:
    batch_size: int
    max_delay_ms: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class RoutingTable:
    """What the running job serves: per model its batching and versions. It travels as text
    (`text`, read by cluster_serving/jvm/java/RoutingTable.java too) in control records on the request topic, so
    that a change takes effect at one position of the request stream (docs/models.md)."""

    generation: int
    default: str
    entries: dict[str, TableEntry]

    @classmethod
    def of(cls, repository: Repository, left_out: frozenset[tuple[str, int]] = frozenset(),
           generation: int | None = None) -> RoutingTable:
        """The table of a repository, without the (model, version) pairs in `left_out` (those that
        failed to load); generation: now in milliseconds unless given."""
        entries = {
            name: TableEntry(servable.batching.batch_size, servable.batching.max_delay_ms, servable.served(left_out))
            for name, servable in sorted(repository.servables.items())
        }
        return cls(generation or time.time_ns() // 1_000_000, repository.default, entries)

    def text(self) -> str:
        lines = [f"{self.generation}\t{self.default}"]
        for name, entry in self.entries.items():
            versions = ",".join(map(str, entry.versions))
            lines.append(f"{name}\t{entry.batch_size}\t{entry.max_delay_ms}\t{versions}")
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> RoutingTable:
        """Raises ValueError for text that is not a table."""
        head, *rows = text.split("\n")
        generation, default = head.split("\t")
        entries = {}
        for row in rows:
            name, batch_size, max_delay_ms, versions = row.split("\t")
            entries[name] = TableEntry(
                int(batch_size), int(max_delay_ms), tuple(int(version) for version in versions.split(",") if version)
            )
        return cls(int(generation), default, entries)

    def describe(self) -> str:
        """What the table serves, as the job's log lines and its Flink UI description say it."""
        return ", ".join(f"{name} v{','.join(map(str, entry.versions))}" for name, entry in self.entries.items())

    def same_serving(self, other: RoutingTable | None) -> bool:
        """Equal but for the generation: no control record needed."""
        return other is not None and (self.default, self.entries) == (other.default, other.entries)


def stage_function(servable: Servable, stage: Stage, kind: str) -> Callable[..., object] | None:
    """The function servable.yaml names for a stage, from the servable's own servable.py: stage
    code comes from the operator's repository, never from a request."""
    if not stage.function:
        return None
    module = _stages_module(servable)
    function = getattr(module, stage.function, None)
    if not callable(function):
        raise ConfigError(f"{servable.stages_file}: no function {stage.function!r} for {kind}")
    return function


def _stages_module(servable: Servable) -> ModuleType:
    path = servable.stages_file
    if not path.is_file():
        raise ConfigError(f"{servable.folder / 'servable.yaml'} names stage functions but {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"cluster_serving_servable_{servable.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a syntax error, a failed import: the servable cannot serve
        raise ConfigError(f"{path} cannot be imported: {type(exc).__name__}: {exc}") from None
    return module


def servable_stages(servable: Servable) -> tuple[Callable[..., object] | None, Callable[..., object] | None]:
    """The servable's preprocess and postprocess functions (None where it names none)."""
    return (
        stage_function(servable, servable.config.preprocess, "preprocess"),
        stage_function(servable, servable.config.postprocess, "postprocess"),
    )


def check_stages(repository: Repository) -> None:
    """Loads every servable's stage functions once: a missing servable.py or function, or one that
    fails to import, is a ConfigError (what starting checks)."""
    for servable in repository.servables.values():
        servable_stages(servable)
