"""The models a job subtask serves: opened as the routing table says, found by a request's route.

The table arrives in control frames (cluster_serving/runtime/frames.py), in order with the batches: the batches before
a control frame were routed by the old table and are answered before it is adopted, so a request
is served by exactly one version. Adopting opens the new versions beside the old ones and only
then closes the versions the table no longer lists. A version that fails to open is logged once and
left out; a request naming no version gets the newest that opened.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster_serving.config import ServingConfig
from cluster_serving.runtime.model import ModelError, OnnxModel
from cluster_serving.runtime.repository import Repository, RoutingTable, Servable, check_stages, scan, servable_stages
from cluster_serving.wire.tensors import config_mismatch

log = logging.getLogger(__name__)
StageFunction = Callable[..., object]
# How much of a model name or version header an error result repeats.
NAME_SHOWN = 100
# Copies of a model on a GPU where `instances` is 0: their host work (decoding, copies into
# place) overlaps the others' runs, which one copy alone leaves the card idle for.
GPU_INSTANCES = 4


class RouteError(LookupError):
    """A request names a model or version that is not served: its error result's text and code
    (unknown_model, unknown_version; internal for a pipeline step whose model is not open)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def open_version(servable: Servable, version: int, config: ServingConfig) -> OnnxModel:
    """One version's session, as `config` says (device, model.threads, model.float16,
    model.cuda_graph), checked against its servable.yaml (inputs, outputs, image inputs)."""
    settings = servable.config
    batching = servable.batching
    model = OnnxModel(
        servable.path(version), config.device, settings.inputs, settings.outputs, config.model.threads,
        settings.preprocess.images, float16=config.model.float16,
        graph_rows=(batching.run_batch_size or batching.batch_size) if config.model.cuda_graph else 0,
    )
    problem = config_mismatch(
        [spec.name for spec in model.inputs], model.output_names, image_inputs=tuple(settings.preprocess.images)
    )
    if problem:
        raise ModelError(f"model {servable.name!r} version {version}: {problem}")
    return model


class InstancePool:
    """The open copies of one model version (servable.yaml `instances`): a batch runs on one
    that no other thread is running, so that each copy's session and buffers have one user."""

    def __init__(self, copies: list[OnnxModel], asked: int):
        self.asked = asked  # the `instances` setting it was opened under (0: as its device suits)
        self.copies = copies
        self.first = copies[0]
        self.free: queue.SimpleQueue[OnnxModel] = queue.SimpleQueue()
        for copy in copies:
            self.free.put(copy)
            if len(copies) > 1 and copy.runner is not None:
                copy.runner.copy_threads = 1  # copies side by side overlap their copies already

    @property
    def size(self) -> int:
        return len(self.copies)

    @contextmanager
    def instance(self) -> Iterator[OnnxModel]:
        """A free copy for the time of the block, waiting for one when all are running."""
        model = self.free.get()
        try:
            yield model
        finally:
            self.free.put(model)


@dataclass
class Served:
    """One servable as this subtask serves it: its reading, stage functions and open versions
    (`models`: each version's first copy, which says what it takes; `pools`: all its copies)."""

    servable: Servable
    preprocess: StageFunction | None
    postprocess: StageFunction | None
    pools: dict[int, InstancePool]

    @property
    def models(self) -> dict[int, OnnxModel]:
        return {version: pool.first for version, pool in self.pools.items()}

    @property
    def versions(self) -> list[int]:
        """The versions requests can name: the open ones (a pipeline's own, which opens nothing)."""
        return list(self.servable.versions) if self.servable.is_pipeline else sorted(self.models)


class Servables:
    def __init__(self, config: ServingConfig):
        self.config = config
        self.table: RoutingTable | None = None
        self.served: dict[str, Served] = {}
        self.failed: set[tuple[str, int, Path | None]] = set()

    def adopt(self, table: RoutingTable) -> None:
        """Serves `table`. The JVM batcher decides which tables are adopted, and in what order
        (MicroBatchOperator.java): every table it sends is taken, the one held already excepted."""
        if table == self.table:
            return
        repository = scan(self.config)
        served: dict[str, Served] = {}
        for name, entry in table.entries.items():
            servable = repository.servables.get(name) or (self.served[name].servable if name in self.served else None)
            if servable is None:
                log.error("model %s: in the routing table but no longer in the repository; not served", name)
                continue
            served[name] = self._serve(servable, entry.versions)
        self.served, self.table = served, table
        log.info(
            "serving %s (routing table %d)",
            "; ".join(f"{name} versions {item.versions or '-'}" for name, item in served.items()) or "nothing",
            table.generation,
        )

    def _serve(self, servable: Servable, versions: tuple[int, ...]) -> Served:
        """The servable with `versions` open: those open already are kept, new ones opened."""
        previous = self.served.get(servable.name)
        pools: dict[int, InstancePool] = {}
        for version in versions:
            if servable.is_pipeline:
                continue
            if version not in servable.files:  # a table from a control record no poller wrote
                log.error("model %s version %d: in the routing table but not in the repository", servable.name, version)
                continue
            if (previous is not None and version in previous.pools and previous.pools[version].asked == servable.config.instances
                    and previous.servable.files.get(version) == servable.files.get(version)):
                pools[version] = previous.pools[version]
                continue
            pool = self._open(servable, version)
            if pool is not None:
                pools[version] = pool
        try:
            pre, post = servable_stages(servable)
        except Exception as exc:  # a broken servable.py: its model answers errors, the others serve
            log.error("model %s: stages not loaded: %s", servable.name, exc)
            pre = post = _broken_stage(f"stages not loaded: {exc}")
        return Served(servable, pre, post, pools)

    def _open(self, servable: Servable, version: int) -> InstancePool | None:
        key = (servable.name, version, servable.files.get(version))
        try:
            copies = [open_version(servable, version, self.config)]
            count = servable.config.instances or (GPU_INSTANCES if copies[0].provider == "CUDAExecutionProvider" else 1)
            copies += [open_version(servable, version, self.config) for _ in range(count - 1)]
        except Exception as exc:  # ModelError, or whatever a file the poller did not check raises
            if key not in self.failed:
                log.error("model %s version %d not served: %s", servable.name, version, exc)
                self.failed.add(key)
            return None
        count = f" ({len(copies)} instances)" if len(copies) > 1 else ""
        log.info("opened model %s version %d on %s%s", servable.name, version, copies[0].provider, count)
        return InstancePool(copies, servable.config.instances)

    def resolve(self, model: str, version: str) -> tuple[Served, int]:
        """The servable and version a batch's route names; RouteError says what is served instead."""
        name = model or (self.table.default if self.table else "")
        served = self.served.get(name)
        if served is None:  # a header any producer wrote: shown cut short, as the uri of a log line is
            raise RouteError(
                f"unknown model {name[:NAME_SHOWN]!r}; the repository serves {', '.join(sorted(self.served)) or 'nothing'}", "unknown_model"
            )
        listed = served.versions
        if not version:
            if not listed:
                raise RouteError(f"model {name!r}: none of its versions opened (see the job's log)", "unknown_version")
            return served, listed[-1]
        if not (version.isascii() and version.isdigit()) or int(version) not in listed:
            shown = version[:NAME_SHOWN]
            raise RouteError(f"model {name!r} has no version {shown}; it serves {', '.join(map(str, listed)) or 'none'}", "unknown_version")
        return served, int(version)

    def step(self, name: str, version: int | None) -> tuple[Served, int]:
        """A pipeline step's model and version: `version`, or the newest open."""
        served = self.served.get(name)
        if served is None or served.servable.is_pipeline or not served.models or (
            version is not None and version not in served.models
        ):
            raise RouteError(f"model {name!r} version {version or 'newest'} is not open", "internal")
        return served, version if version is not None else max(served.models)


def _broken_stage(reason: str) -> StageFunction:
    def fail(*_: object) -> object:
        raise RuntimeError(reason)

    return fail


def repository_check(config: ServingConfig, repository: Repository) -> None:
    """Opens every version once and loads every servable's stages: what the job checks before it
    runs, each problem one line."""
    for servable in repository.servables.values():
        for version in servable.versions if not servable.is_pipeline else ():
            open_version(servable, version, config)
    check_stages(repository)
