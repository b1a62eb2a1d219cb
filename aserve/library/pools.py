"""Worker processes on several devices, as one pool the batcher drives (on the loop).

A :class:`aserve.workers.batch_process.ProcessPool` runs its children on one
device. ``Batched(..., workers=N, devices=[...])`` spreads its workers over
several, so it runs one pool per device and this class puts them behind the
pool interface the batcher knows (an :class:`~aserve.workers.job.EnginePool`,
whose children are :class:`~aserve.workers.job.ChildProcesses` too): each
batch goes to the pool with the most free workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from aserve.workers.batch_process import ProcessPool
from aserve.workers.job import BatchJob


def spread(workers: int, devices: Sequence[str]) -> list[tuple[str, int]]:
    """``(device, workers)`` per entry of ``devices`` that gets any: worker ``i`` runs on
    ``devices[i % len(devices)]``. A device listed twice gets two pools (so a
    test can spread over ``["cpu", "cpu"]``); that serves as one pool would."""
    counts = [0] * len(devices)
    for i in range(workers):
        counts[i % len(devices)] += 1
    return [(d, n) for d, n in zip(devices, counts, strict=True) if n]


class DevicePools:
    """Several process pools (one per device) as one."""

    def __init__(self, pools: Sequence[ProcessPool]) -> None:
        self.pools = list(pools)
        self.engine = self.pools[0].engine
        self._busy = [0] * len(self.pools)  # batches out, per pool
        self.on_live: Callable[[], Any] | None = None
        for pool in self.pools:
            pool.on_live = self._live_changed

    @property
    def live(self) -> int:
        return sum(p.live for p in self.pools)

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.pools)

    @property
    def pids(self) -> list[int]:
        return [pid for p in self.pools for pid in p.pids]

    async def start(self) -> None:
        results = await asyncio.gather(*(p.start() for p in self.pools), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    def submit(self, job: BatchJob) -> None:
        index = max(range(len(self.pools)), key=lambda i: self.pools[i].live - self._busy[i])
        self._busy[index] += 1
        done = job.on_done

        def finished(j: BatchJob) -> None:
            self._busy[index] -= 1
            done(j)

        job.on_done = finished
        self.pools[index].submit(job)

    async def stop(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(p.stop(timeout) for p in self.pools))

    def _live_changed(self) -> None:
        if self.on_live is not None:
            self.on_live()
