"""The folder layout is the architecture: each room imports only the rooms below it.

    ops (CLI, processes)  ->  bridge (HTTP)  |  client (InputQueue, OutputQueue)  |  job (Flink)
                          ->  connectors (wire format, Kafka, Flink REST)  ->  conf

bench/ and tests/ are the development harness: they may import any room, no room imports them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Room -> the rooms it may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "conf": set(),
    "connectors": {"conf"},
    "job": {"connectors", "conf"},
    "client": {"connectors", "conf"},
    "bridge": {"connectors", "conf"},
    "ops": {"bridge", "client", "connectors", "conf"},
}
HARNESS = {"bench", "tests"}
ROOMS = set(ALLOWED) | HARNESS


def imported_rooms(path: Path) -> set[str]:
    """The project's rooms a module imports, at any depth of the module (lazy imports included)."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        rooms |= {name.split(".")[0] for name in names} & ROOMS
    return rooms


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_the_rooms_below_it(room: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(imported_rooms(path) - ALLOWED[room] - {room})
        for path in sorted((ROOT / room).rglob("*.py"))
    }
    assert {module: rooms for module, rooms in wrong.items() if rooms} == {}


def test_the_client_library_imports_without_flink_fastapi_or_the_job() -> None:
    """Users install the client beside their application: it must not drag the server in."""
    probe = (
        "import sys, client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyflink', 'fastapi', 'uvicorn', 'job', 'bridge', 'ops', 'onnxruntime'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
