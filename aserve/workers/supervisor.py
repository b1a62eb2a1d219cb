"""What the server's child processes (decoder step process, worker processes) share.

Parent side: :func:`start` and :func:`reap` a child, :func:`restart_delay`
between failed restarts. Child side: :func:`settle_child`, the setup every
child does first. The pipe between them is :mod:`aserve.workers.pipe`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from aserve import logs
from aserve.config import GpuConfig
from aserve.engines.gpu_memory import CacheReleaser, apply_memory_limit, cuda_indices

log = logging.getLogger("aserve.executor")

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


def start(
    target: Callable[..., None], args: tuple[Any, ...], name: str
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """Start ``target(child_conn, *args)`` in a new process; its process and the server's end."""
    # spawn, not fork: the server has threads (gRPC, torch) a fork would copy half of.
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()  # the parent's copy: EOF must reach the server when the child exits
    return proc, parent


def reap(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait for ``proc`` to exit (blocking: call off the loop); kill it after ``timeout``."""
    proc.join(timeout)
    if proc.is_alive():
        log.warning("child process %s did not stop within %.1fs; killing it", proc.name, timeout)
        proc.kill()
        proc.join(5.0)


def restart_delay(attempt: int) -> float:
    """Seconds to wait after the ``attempt``-th failed restart (0-based)."""
    return _RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)]


def settle_child(device: str, gpu: dict[str, Any]) -> CacheReleaser | None:
    """In the child, first: signals, logs, and the server's ``"gpu"`` block for ``device``.

    The server decides when a child ends (a stop message, or its pipe
    closing), so SIGINT/SIGTERM sent to the whole group are ignored. The
    memory cap is per process, so the server's is applied here too; the
    returned releaser (None without one) empties the cache periodically.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure("WARNING", os.environ.get(logs.FORMAT_ENV, "text"))
    indices = cuda_indices([device])
    if not indices:
        return None
    import torch

    config = GpuConfig(**gpu)
    apply_memory_limit(torch.cuda, config, indices)
    if config.empty_cache_interval_s is None:
        return None
    return CacheReleaser(torch.cuda, config.empty_cache_interval_s)
