"""The folder layout is the architecture: each room of `cluster_serving` imports only the rooms
below it.

    ops (CLI, processes, local broker, Flink cluster)
      -> http (the bridge) | client (InputQueue, OutputQueue) | job (Flink wiring)
      -> runtime (the Flink-free serving core) | kafka (admin, librdkafka, settings)
      -> wire (format, tensors, input kinds) | jvm (Java, jars) | net (Flink REST, ports)
      -> config

bench/ and tests/ are the development harness: they may import any room, no room imports them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cluster_serving"
# Room -> the rooms it may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "net": set(),
    "jvm": {"config"},
    "wire": {"config"},
    "kafka": {"wire", "config"},
    "runtime": {"wire", "config"},
    "job": {"runtime", "kafka", "wire", "jvm", "net", "config"},
    "client": {"kafka", "wire", "config"},
    "http": {"runtime", "kafka", "wire", "net", "config"},
    "ops": {"http", "client", "runtime", "kafka", "wire", "jvm", "net", "config"},
}
# Inside a room, sub-rooms with their own arrows: the bridge's app sits above its protocol
# routers, which sit above the ASGI pieces they share.
SUB_ROOMS: dict[str, set[str]] = {
    "http.asgi": set(),
    "http.protocol": {"http.asgi"},
}
# What assembles a room's sub-rooms: nothing inside them imports it.
ASSEMBLY = {"http.app", "http.server"}


def imported_modules(path: Path) -> set[str]:
    """The package's modules a module imports, at any depth of it (lazy imports included), without
    the `cluster_serving.` prefix."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        modules |= {name.removeprefix("cluster_serving.") for name in names if name.startswith("cluster_serving.")}
    return modules


def rooms_of(modules: set[str]) -> set[str]:
    return {module.split(".")[0] for module in modules}


def test_the_package_has_these_rooms_and_nothing_else_at_its_top() -> None:
    rooms = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    modules = {path.name for path in PACKAGE.glob("*.py")}
    assert rooms == set(ALLOWED) and modules == {"__init__.py"}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(rooms_of(imported_modules(path)) - ALLOWED[room] - {room})
        for path in sorted((PACKAGE / room).rglob("*.py"))
    }
    assert {module: rooms for module, rooms in wrong.items() if rooms} == {}


@pytest.mark.parametrize("sub_room", sorted(SUB_ROOMS))
def test_a_sub_room_imports_no_sibling_above_it(sub_room: str) -> None:
    forbidden = tuple(({other for other in SUB_ROOMS if other != sub_room} - SUB_ROOMS[sub_room]) | ASSEMBLY)
    wrong = {
        str(path.relative_to(ROOT)): sorted(module for module in imported_modules(path) if module.startswith(forbidden))
        for path in sorted((PACKAGE / sub_room.replace(".", "/")).rglob("*.py"))
    }
    assert {module: above for module, above in wrong.items() if above} == {}


def test_no_room_imports_the_harness() -> None:
    harness = {
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if {name.split(".")[0] for name in _top_level_imports(path)} & {"bench", "tests"}
    }
    assert harness == set()


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_client_library_imports_without_flink_fastapi_or_the_job() -> None:
    """Users install the client beside their application: it must not drag the server in."""
    probe = (
        "import sys; from cluster_serving import InputQueue, OutputQueue; "
        "print(sorted({m for m in sys.modules if m.split('.')[0] in {'pyflink', 'fastapi', 'uvicorn', 'onnxruntime'}"
        " or m.startswith(('cluster_serving.job', 'cluster_serving.http', 'cluster_serving.ops', 'cluster_serving.runtime'))}))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_the_runtime_imports_without_flink_kafka_clients_or_http() -> None:
    """The serving core runs where only Python and ONNX Runtime are (a GPU box without Java)."""
    probe = (
        "import sys; import cluster_serving.runtime.serve; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyflink', 'kafka', 'confluent_kafka', 'fastapi', 'uvicorn', 'py4j'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
