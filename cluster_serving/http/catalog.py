"""The models the bridge serves: the repository as it last read it, each served version with its
signature, and the target a request names (model and version) resolved against it.

Read at start with `bridge.model_info.repository_signatures` (a problem there is the one-line
start error). While the bridge runs, the repository is read again (in a thread: reading a new
model's graph can take a while) for the listing and metadata routes when the last reading is
older than a second, and for a request naming a model or version it does not know, at most once a
second, before that request is answered 404: a model added to the repository is served by the
bridge as soon as the job serves it. A model whose servable.yaml turns broken keeps its last good
reading (the job's poller keeps serving it too); a version whose file cannot be read is left out
and listed as unavailable, with why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from cluster_serving.config import ConfigError, ServingConfig
from cluster_serving.http.errors import ModelNotFound
from cluster_serving.runtime.repository import Repository, Servable, rescan
from cluster_serving.runtime.signature import ModelSignature, repository_signatures, request_input, servable_signature
from cluster_serving.wire.inputs import Headers, request_headers

log = logging.getLogger("cluster_serving.http")
RESCAN_INTERVAL_S = 1.0
MODEL_PLATFORM = "onnxruntime_onnx"
PIPELINE_PLATFORM = "ensemble"  # Triton's name for a pipeline of models


@dataclass(frozen=True)
class Target:
    """What a request is for: a model and the version it named (None: the newest the job serves),
    the signature its inputs are typed by, and the Kafka record headers that carry both."""

    model: str
    version: int | None
    signature: ModelSignature
    image_inputs: frozenset[str]
    headers: Headers

    @property
    def version_label(self) -> str:
        return "latest" if self.version is None else str(self.version)


@dataclass(frozen=True)
class Reading:
    """One reading of the repository: the servables with at least one readable version, each
    readable version's signature, and the versions left out with why."""

    repository: Repository
    signatures: dict[tuple[str, int], ModelSignature]
    unavailable: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def servables(self) -> dict[str, Servable]:
        return self.repository.servables

    def describe(self) -> str:
        return ", ".join(sorted(self.servables)) or "nothing"

    def servable(self, name: str) -> Servable:
        servable = self.servables.get(name)
        if servable is None:
            raise ModelNotFound(f"model {name!r} not found; the repository serves {self.describe()}")
        return servable

    def version(self, servable: Servable, version: str | int | None) -> int:
        """The version a request names, served; None: the newest."""
        if version is None:
            return servable.versions[-1]
        text = str(version)
        number = int(text) if text.isascii() and text.isdigit() else 0
        if number not in servable.versions:
            problem = self.unavailable.get((servable.name, number))
            if problem:
                raise ModelNotFound(f"model {servable.name!r} version {number} is not available: {problem}")
            served = ", ".join(map(str, servable.versions))
            raise ModelNotFound(f"model {servable.name!r} has no version {text}; it serves {served}")
        return number


def read(config: ServingConfig, previous: Reading | None = None) -> Reading:
    """The repository as it is on disk now. With a `previous` reading (while running), problems
    leave things out instead of raising: a model with a broken servable.yaml keeps its previous
    reading, a version that cannot be read is left out."""
    if previous is None:
        repository, signatures = repository_signatures(config)
        return Reading(repository, signatures)
    try:
        repository = rescan(config, previous.repository)
    except ConfigError as exc:  # the folder itself went away: keep serving what is known
        log.warning("rescanning the model repository failed: %s", exc)
        return previous
    signatures: dict[tuple[str, int], ModelSignature] = {}
    unavailable: dict[tuple[str, int], str] = {}
    single = config.models.repository is None
    kept: dict[str, Servable] = {}
    # Models first: a pipeline's steps take the newest version of theirs that can be read, as the
    # job's do (it leaves out a version that fails to load).
    for pipelines in (False, True):
        readable = Repository(kept, repository.default)
        for name, servable in repository.servables.items():
            if servable.is_pipeline != pipelines:
                continue
            # Every version in the folder, as the job's poller does: the policy then picks among
            # the readable ones, so a broken newest version leaves the one before it served.
            for version in servable.versions if servable.is_pipeline else sorted(servable.files):
                try:
                    signatures[(name, version)] = servable_signature(readable, servable, version, single)
                except ConfigError as exc:
                    unavailable[(name, version)] = str(exc)
                except Exception as exc:  # whatever else a half-written file makes onnx raise
                    unavailable[(name, version)] = f"{type(exc).__name__}: {exc}"
            versions = servable.served(frozenset(key for key in unavailable if key[0] == name))
            if versions:
                kept[name] = servable if versions == servable.versions else _with_versions(servable, versions)
    for name, problem in repository.problems.items():  # reported once per change, as the job's poller does
        if previous.repository.problems.get(name) != problem:
            state = "still served as last read" if name in previous.servables else "left out"
            log.warning("model %s %s: %s", name, state, problem)
    for key, problem in unavailable.items():
        if previous.unavailable.get(key) != problem:
            log.warning("not serving %s version %d: %s", key[0], key[1], problem)
    return Reading(Repository(dict(sorted(kept.items())), repository.default, repository.problems), signatures, unavailable)


def _with_versions(servable: Servable, versions: tuple[int, ...]) -> Servable:
    files = {version: path for version, path in servable.files.items() if version in versions}
    return Servable(servable.name, servable.folder, servable.config, versions, servable.batching, files)


class Catalog:
    """The bridge's current reading of the repository and the targets requests resolve to."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.reading = read(config)  # ConfigError: the start error
        self.read_at = time.monotonic()
        self._targets: dict[tuple[str, int | None], Target] = {}  # by the served name and version
        self._rescan: asyncio.Task[None] | None = None

    @property
    def default(self) -> str:
        return self.reading.repository.default

    def target(self, model: str | None, version: str | None = None) -> Target:
        """The target of a request naming `model` (None: the default) and `version` (None: the
        newest); ModelNotFound, naming what is served, for one this reading does not serve."""
        reading = self.reading
        servable = reading.servable(self.default if model is None else model)
        named = None if version is None else reading.version(servable, version)
        key = (servable.name, named)
        target = self._targets.get(key)
        if target is None:
            headers = request_headers(servable.name, named) or []
            number = servable.versions[-1] if named is None else named
            target = Target(
                servable.name, named, reading.signatures[(servable.name, number)], image_inputs(reading, servable), headers
            )
            self._targets[key] = target
        return target

    async def find(self, model: str | None, version: str | None = None) -> Target:
        """`target`, reading the repository again (at most once a second) before a miss is final."""
        try:
            return self.target(model, version)
        except ModelNotFound:
            if time.monotonic() - self.read_at < RESCAN_INTERVAL_S:
                raise
        await self.refresh(0.0)
        return self.target(model, version)

    async def refresh(self, max_age_s: float = RESCAN_INTERVAL_S) -> Reading:
        """The reading, read again first when it is older than `max_age_s` (and the last rescan,
        whatever asked for it, was at least a second ago); concurrent callers share one rescan."""
        stale = time.monotonic() - self.read_at
        if stale >= max(max_age_s, RESCAN_INTERVAL_S) or (self._rescan is not None):
            if self._rescan is None:
                self._rescan = asyncio.create_task(self._read_again())
            await asyncio.shield(self._rescan)
        return self.reading

    async def _read_again(self) -> None:
        try:
            reading = await asyncio.to_thread(read, self.config, self.reading)
            if reading is not self.reading:
                self.reading = reading
                self._targets = {}
        except Exception:  # a bug: answer with what is known rather than fail every request
            log.exception("rescanning the model repository failed")
        finally:
            self.read_at = time.monotonic()
            self._rescan = None

    def index(self) -> list[dict[str, str]]:
        """KServe's/Triton's repository index: every version, served or left out."""
        reading = self.reading
        entries = [
            {"name": name, "version": str(version), "state": "READY"}
            for name, servable in reading.servables.items() for version in servable.versions
        ]
        entries += [
            {"name": name, "version": str(version), "state": "UNAVAILABLE", "reason": problem}
            for (name, version), problem in reading.unavailable.items()
        ]
        return sorted(entries, key=lambda entry: (entry["name"], int(entry["version"])))


def platform(servable: Servable) -> str:
    return PIPELINE_PLATFORM if servable.is_pipeline else MODEL_PLATFORM


def image_inputs(reading: Reading, servable: Servable) -> frozenset[str]:
    """The inputs a JSON string is an encoded image for: the servable's image inputs; a pipeline's
    own and the request inputs its steps map to an image input of their model."""
    names = set(servable.config.preprocess.images)
    earlier: set[str] = set()
    for index, step in enumerate(servable.config.steps):
        model = reading.servables.get(step.model)
        for name in model.config.preprocess.images if model is not None else ():
            source = request_input(step.inputs, name, index, earlier)
            if source:
                names.add(source)
        earlier.add(step.step_name)
    return frozenset(names)
