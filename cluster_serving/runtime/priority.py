"""The CPU priority of the job's own threads (Linux nice values, which Linux keeps per thread)."""

from __future__ import annotations

import os
import sys
import threading


def set_thread_niceness(niceness: int) -> None:
    """Gives the calling thread this nice value; where the system names no threads so, or does
    not allow it (raising a priority needs privileges), the thread keeps the one it has."""
    if sys.platform != "linux":  # a thread id names the thread there; elsewhere it could name a process
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except OSError:
        pass


def at_process_niceness() -> None:
    """Gives the calling thread the process's own nice value: a thread starts with its starter's,
    which a lowered thread would otherwise pass on."""
    if sys.platform == "linux":
        set_thread_niceness(os.getpriority(os.PRIO_PROCESS, os.getpid()))
