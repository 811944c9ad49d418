"""Peak memory of one action, for tests that a hostile input is refused before it is inflated.

This reads /proc/self/status and writes /proc/self/clear_refs itself rather than going through
psutil (ops.processes' toolkit): psutil reports no peak RSS on Linux and cannot reset it, and the
current RSS is read from the same file so both figures come from one accounting.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def _status_kb(key: str) -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(f"{key}:"))


def peak_rss_growth_mb(action: Callable[[], object]) -> float:
    """How far the process's peak RSS rises above its current RSS while `action` runs (Linux:
    Pillow and Arrow allocate outside Python, where tracemalloc does not look)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before = _status_kb("VmRSS")
    action()
    return (_status_kb("VmHWM") - before) / 1024
