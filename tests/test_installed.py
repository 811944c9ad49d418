"""The project as users install it: a wheel built from the repository, in a fresh venv outside the
clone, and the serving core in a Python without Flink."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cluster_serving.net.ports import port_taken
from cluster_serving.ops.instances import REGISTRY_ENV
from tests.onnx_models import scale_model
from tests.paths import PROJECT_ROOT

BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
DEMO_PORTS = (9092, 8081, 10020)  # broker, Flink web UI, HTTP bridge
# What the runtime needs beyond the standard library: numpy, pyarrow, pyyaml, pydantic, Pillow,
# simplejpeg and ONNX Runtime; as top-level names of site-packages (dist-info folders aside).
RUNTIME_PACKAGES = (
    "numpy", "numpy.libs", "pyarrow", "yaml", "_yaml", "pydantic", "pydantic_core", "annotated_types",
    "typing_extensions.py", "typing_inspection", "PIL", "pillow.libs", "simplejpeg", "onnxruntime",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the committed tree's package files, built as `pip wheel` builds any project."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    shutil.copytree(PROJECT_ROOT / "cluster_serving", source / "cluster_serving", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)], timeout=300)
    [built] = out.glob("cluster_serving-*.whl")
    return built


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{command[:3]}: {done.stdout}{done.stderr}"
    return done


def new_venv(folder: Path) -> Path:
    run([BASE_PYTHON, "-m", "venv", str(folder)], timeout=120)
    return folder / "bin"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel and its dependencies from PyPI, as `pip install` gives a user."""
    bin_dir = new_venv(tmp_path_factory.mktemp("venv") / "venv")
    run([str(bin_dir / "pip"), "install", "-q", str(wheel)], timeout=900)
    yield bin_dir


def test_the_wheel_installs_one_package_and_the_command(installed: Path) -> None:
    probe = (
        "import importlib.metadata as m, json; d = m.distribution('cluster-serving'); "
        "print(json.dumps([sorted({str(f).split('/')[0] for f in d.files if not str(f).startswith(('cluster_serving-', '../'))}),"
        " [e.name for e in d.entry_points if e.group == 'console_scripts']]))"
    )
    # -P, and a folder of its own: the clone's metadata (cluster_serving.egg-info) must not answer.
    top_level, scripts = json.loads(run([str(installed / "python"), "-P", "-c", probe], timeout=60, cwd=installed).stdout)
    assert (top_level, scripts) == (["cluster_serving"], ["cluster-serving"])


def test_the_installed_command_runs_in_a_folder_with_packages_of_its_own(installed: Path, tmp_path: Path) -> None:
    """A user's project with conf/ and job/ packages (the old top-level names) and even a
    cluster_serving/ folder of its own: the installed CLI and its children still use the install."""
    for name in ("conf", "job", "cluster_serving"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the user folder was imported')\n")
    version = run([str(installed / "cluster-serving"), "--version"], timeout=60, cwd=tmp_path)
    assert re.fullmatch(r"cluster-serving \d+\.\d+\.\d+\n", version.stdout)
    init = run([str(installed / "cluster-serving"), "init", "served"], timeout=120, cwd=tmp_path)
    assert (tmp_path / "served" / "config.yaml").is_file() and (tmp_path / "served" / "model.onnx").is_file(), init.stdout
    where = run([str(installed / "python"), "-P", "-c", "import cluster_serving; print(cluster_serving.__file__)"], timeout=60, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(installed.parent)


@pytest.mark.skipif(
    any(port_taken("127.0.0.1", port) for port in DEMO_PORTS),
    reason="the demo's fixed ports 9092 (broker), 8081 (Flink UI) or 10020 (HTTP) are taken on this machine",
)
def test_the_installed_demo_prints_predictions(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "__init__.py").write_text("raise ImportError('the user folder was imported')\n")
    demo = run(
        [str(installed / "cluster-serving"), "demo", "--no-wait", "--requests", "3", "--folder", "demo"], timeout=300,
        cwd=tmp_path, env={**os.environ, REGISTRY_ENV: str(tmp_path / "registry"), "PATH": f"{installed}:{os.environ['PATH']}"},
    )
    predictions = re.findall(r"^demo-(\d): class (\d) \(p=[01]\.\d{3}\)$", demo.stdout, re.MULTILINE)
    assert sorted(uri for uri, _ in predictions) == ["0", "1", "2"], demo.stdout
    assert re.search(r"^POST http://127\.0\.0\.1:10020/predict: class \d", demo.stdout, re.MULTILINE)
    assert not any(port_taken("127.0.0.1", port) for port in DEMO_PORTS)


RUNTIME_SCRIPT = """
import importlib.util, json, sys
import numpy as np
from cluster_serving.config import load_config
from cluster_serving.runtime.frames import read_result_frame, write_batch_frame, write_control_frame
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import Message, decode_message, encode_message

config = load_config(overrides={"model.path": sys.argv[1], "model.inputs": ["x"], "device": "cpu"})
server = BatchServer(config)
server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
rows = np.arange(12, dtype=np.float32).reshape(3, 4)
records = [(f"u{i}", encode_message(Message(f"u{i}", {"x": row}))) for i, row in enumerate(rows)] + [("bad", b"junk")]
results = {uri: decode_message(bytes(payload), 1 << 20) for uri, payload in read_result_frame(server.serve_frame(write_batch_frame("", "", records)))}
print(json.dumps({
    "absent": [name for name in ("pyflink", "kafka", "confluent_kafka", "fastapi") if importlib.util.find_spec(name)],
    "results": {uri: message.tensors["y"].tolist() for uri, message in results.items() if message.error is None},
    "errors": {uri: message.error for uri, message in results.items() if message.error},
}))
"""


def test_the_runtime_serves_a_batch_in_a_python_without_flink(wheel: Path, tmp_path: Path) -> None:
    """A venv holding the wheel and only the runtime's own dependencies (linked from this venv's
    site-packages): no apache-flink, no Kafka client, no HTTP stack."""
    bin_dir = new_venv(tmp_path / "venv")
    run([str(bin_dir / "pip"), "install", "-q", "--no-deps", str(wheel)], timeout=300)
    ours = Path(ort.__file__).resolve().parents[1]
    linked = tmp_path / "runtime-packages"
    linked.mkdir()
    for name in RUNTIME_PACKAGES:
        (linked / name).symlink_to(ours / name)
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    (site / "runtime-packages.pth").write_text(f"{linked}\n")
    model = scale_model(tmp_path / "scale.onnx", 3.0)

    served = json.loads(run([str(bin_dir / "python"), "-P", "-c", RUNTIME_SCRIPT, str(model)], timeout=120, cwd=tmp_path).stdout)

    assert served["absent"] == []
    expected = ort.InferenceSession(str(model)).run(None, {"x": np.arange(12, dtype=np.float32).reshape(3, 4)})[0]
    assert served["results"] == {f"u{i}": row.tolist() for i, row in enumerate(expected)}
    assert served["errors"].keys() == {"bad"} and served["errors"]["bad"].startswith("bad request:")
