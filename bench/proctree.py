"""CPU time of a server's whole process tree (psutil)."""

from __future__ import annotations

import psutil


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants, threads included."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue  # a child that exited between listing and reading
        total += t.user + t.system
    return total


def system_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)
