"""Reading what a model's load costs in memory: RSS, the CUDA allocator, file sizes.

Layer: engines (no asyncio). Each reader is a quick system call or a read of
``/proc``; :func:`import_engine_libraries` and :func:`files_bytes` touch the
disk and run off the loop. :mod:`aserve.loop.memory_budget` reads these before
and after a load and keeps the difference as the model's footprint:

- on a CUDA device, ``torch.cuda.memory_allocated`` of that device (the
  caching allocator's live tensors; what it caches beyond them is free for
  the next model's tensors);
- on the CPU, the process's resident set (``/proc/self/statm``);
- in worker processes, the children's resident sets after the load (each
  holds its own copy of the interpreter and the model);
- where a process cannot tell (CUDA in worker processes, no ``/proc``), the
  size of the model's files.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# The libraries an engine imports on its first load: imported before the first
# measurement, so that a footprint is the model's and not, say, torch's.
_LIBRARIES = {"torch": ("torch",), "onnx": ("onnxruntime",), "tensorrt": ("torch",)}


def rss_bytes(pid: int | str = "self") -> int | None:
    """The resident set of process ``pid`` in bytes, or None where ``/proc`` cannot say."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def children_rss_bytes(pids: Iterable[int]) -> int | None:
    """The resident sets of ``pids`` together, or None when any cannot be read."""
    total = 0
    for pid in pids:
        rss = rss_bytes(pid)
        if rss is None:
            return None
        total += rss
    return total


def cuda_allocated_bytes(device: str) -> int | None:
    """What torch's caching allocator has allocated on ``device`` (``cuda``,
    ``cuda:N``) in this process, or None without torch or CUDA."""
    import sys

    torch = sys.modules.get("torch")  # imported by import_engine_libraries, if at all
    if torch is None or not torch.cuda.is_available():
        return None
    index = int(device.partition(":")[2] or 0)
    return int(torch.cuda.memory_allocated(index))


def import_engine_libraries(engine: str) -> None:
    """Import what ``engine``'s first load would (blocking: off the loop)."""
    for name in _LIBRARIES.get(engine, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the load itself says the library is missing


def files_bytes(path: Path | None) -> int:
    """The size of a model's file, or of every file under its folder (blocking)."""
    if path is None:
        return 0
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0
