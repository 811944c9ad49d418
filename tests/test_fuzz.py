"""The fuzz targets of tests/fuzz in CI: every seed of the corpus replayed in-process (exact, fast,
names the file that fails), then each target fuzzed by atheris for a few seconds in a subprocess
(FUZZ_SECONDS each, default 6: about 30 s for the four), which must end with exit code 0.

Longer runs on demand: see tests/fuzz/fuzz_decoder.py, e.g.
    python -m tests.fuzz.fuzz_decoder --target image -max_total_time=600 tests/fuzz/corpus/image
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz import targets

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
SECONDS = int(os.environ.get("FUZZ_SECONDS", "6"))
RSS_LIMIT_MB = 2048
TIMEOUT_S = 30  # per input: a slow input is a bug too (libFuzzer reports it as a timeout)


def seeds() -> list[tuple[str, Path]]:
    return [(target, path) for target in targets.TARGETS for path in sorted((CORPUS / target).iterdir())]


@pytest.mark.parametrize(("target", "path"), seeds(), ids=lambda x: x.name if isinstance(x, Path) else x)
def test_seed_corpus(target: str, path: Path) -> None:
    targets.TARGETS[target](path.read_bytes())


@pytest.mark.parametrize("target", list(targets.TARGETS))
def test_fuzz_for_a_few_seconds(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    # New inputs go to the first (scratch) folder, so the repository's seed corpus stays as it is.
    scratch, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    scratch.mkdir()
    artifacts.mkdir()
    command = [
        sys.executable, "-m", "tests.fuzz.fuzz_decoder", f"--target={target}",
        f"-max_total_time={SECONDS}", f"-rss_limit_mb={RSS_LIMIT_MB}", f"-timeout={TIMEOUT_S}",
        f"-artifact_prefix={artifacts}/", "-print_final_stats=1", str(scratch), str(CORPUS / target),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 240)
    output = result.stdout + result.stderr
    done = re.search(r"Done (\d+) runs in (\d+) second", output)
    if done:
        runs, seconds = int(done[1]), max(int(done[2]), 1)
        print(f"fuzz target {target}: {runs} executions in {seconds} s ({runs // seconds}/s)")
    else:  # stopped early (a crash): libFuzzer's final stats still count the executions
        units = re.search(r"stat::number_of_executed_units: *(\d+)", output)
        print(f"fuzz target {target}: stopped after {units[1] if units else '?'} executions")
    crashes = [f"{path.name}: {path.read_bytes()[:200].hex()}" for path in sorted(artifacts.iterdir())]
    uncaught = output.find("=== Uncaught Python exception")
    report = output[uncaught:uncaught + 4000] if uncaught >= 0 else output[-4000:]
    assert result.returncode == 0, (
        f"fuzz target {target} failed (exit code {result.returncode}); reproducers (first 200 bytes, "
        f"hex): {crashes}; replay: python -m tests.fuzz.fuzz_decoder --target {target} FILE\n{report}"
    )
    assert done, output[-3000:]
