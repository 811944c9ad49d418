"""The documentation site builds without a warning (`mkdocs build --strict`: every page in the
navigation, every link resolves), the README stays a front door, and the configuration
reference covers every key of the schema."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster_serving.config.reference import config_reference, schema_keys
from cluster_serving.config.schema import ServingConfig
from tests.paths import PROJECT_ROOT


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    configuration = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "<code>batching.run_batch_size</code>" in configuration and "config-reference" not in configuration


def test_the_readme_is_a_front_door() -> None:
    assert len((PROJECT_ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_configuration_reference_has_every_key_once() -> None:
    rows = [line for line in config_reference().splitlines() if line.startswith("| `")]
    keys = [row.split("`")[1] for row in rows]
    assert keys == [key for key, _ in schema_keys(ServingConfig)] and len(set(keys)) == len(keys)
    assert all(row.rstrip(" |").split(" | ")[-1].strip() for row in rows), "a key without a description"
