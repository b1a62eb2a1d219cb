"""The ``"gpu"`` block: a memory limit per CUDA device and a periodic cache release.

Both go through torch's caching allocator, the one every torch model on the
device allocates from: ``set_per_process_memory_fraction`` caps what it may
hold (past the cap an allocation raises ``torch.cuda.OutOfMemoryError``,
which fails the batch that asked, not the server), and ``empty_cache`` hands
blocks no tensor uses back to the driver. The limit is per process, so a
decoder model's step process applies it too (:mod:`aserve.workers.step_process`).

``cuda`` is ``torch.cuda`` in the server; the functions take it as a
parameter so that their arithmetic can be checked on machines without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from aserve.config import GpuConfig

log = logging.getLogger("aserve.gpu")

MIB = 2**20


def cuda_indices(devices: Iterable[str]) -> list[int]:
    """The CUDA device indices among model ``device`` strings ("cuda" is 0)."""
    found = set()
    for device in devices:
        kind, _, index = device.partition(":")
        if kind == "cuda":
            found.add(int(index or 0))
    return sorted(found)


def apply_memory_limit(cuda: Any, config: GpuConfig, indices: Iterable[int]) -> dict[int, float]:
    """Cap torch's memory on each device at ``config.mem_limit_mib``.

    Returns the fraction of each device's memory that was set. A limit at or
    over the device's size leaves it uncapped (fraction 1.0), with a warning.
    """
    if config.mem_limit_mib is None:
        return {}
    fractions = {}
    for index in indices:
        total = cuda.get_device_properties(index).total_memory
        fraction = config.mem_limit_mib * MIB / total
        if fraction >= 1.0:
            log.warning(
                "gpu.mem_limit_mib %d is at or over the %d MiB of cuda:%d; no cap applied",
                config.mem_limit_mib, total // MIB, index,
            )  # fmt: skip
            fraction = 1.0
        cuda.set_per_process_memory_fraction(fraction, index)
        fractions[index] = fraction
        log.info("cuda:%d: torch may hold at most %d MiB", index, int(fraction * total) // MIB)
    return fractions


def gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


class CacheReleaser:
    """Calls ``empty_cache`` every ``interval_s``: on a worker thread from the
    server's loop (``aserve.server``), or between steps in a step process (:meth:`maybe`)."""

    def __init__(self, cuda: Any, interval_s: float) -> None:
        self._cuda = cuda
        self.interval_s = interval_s
        self._last = time.monotonic()
        self.releases = 0

    def release(self) -> None:
        self._cuda.empty_cache()  # every device's unused cached blocks
        self._last = time.monotonic()
        self.releases += 1

    def maybe(self) -> None:
        """Release if the interval has passed (cheap to call after every step)."""
        if time.monotonic() - self._last >= self.interval_s:
            self.release()
