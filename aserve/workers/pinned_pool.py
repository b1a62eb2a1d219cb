"""Instance threads that each take only their own jobs: a ``direct`` sequence model's.

Layer: ``workers``. Under ``direct`` sequence batching each sequence is bound to
one instance (:mod:`aserve.sched.direct`), so its requests must run there and
nowhere else. :class:`PinnedPool` is an :class:`~aserve.workers.thread_pool.ExecutorPool`
whose threads each read a queue of their own; :meth:`PinnedPool.instance` is
the executor of one instance, which the model's batcher for that instance
holds (one batcher per instance, so a batch never mixes instances). Jobs
submitted to the pool itself (warm-up's) go to the instances in turn.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from aserve.engines.base import Engine
from aserve.workers.job import BatchJob, Staged
from aserve.workers.thread_pool import _STOP, ExecutorPool


class PinnedPool(ExecutorPool):
    """``instances`` threads serving one engine, each fed by a queue of its own."""

    def __init__(self, engine: Engine, instances: int, name: str) -> None:
        super().__init__(engine, instances, name)
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(instances)]
        self._turn = 0  # the instance that the next unpinned job goes to
        # Jobs each instance was given (warm-up's among them): the statistics show them.
        self.batches = [0] * instances
        self._views = [InstanceExecutor(self, i) for i in range(instances)]
        self.on_live = self._fan_out

    def _queue_of(self, index: int) -> queue.SimpleQueue[Any]:
        return self._queues[index]

    def _send_stops(self, threads: int) -> None:
        for jobs in self._queues:
            jobs.put(_STOP)

    def instance(self, index: int) -> InstanceExecutor:
        """The executor that runs jobs on instance ``index`` alone."""
        return self._views[index]

    def is_live(self, index: int) -> bool:
        """Whether instance ``index``'s thread runs (it is not being restarted)."""
        return index not in self._down

    def submit(self, job: BatchJob) -> None:
        """Run ``job`` on the next instance in turn (warm-up: a batch on each)."""
        index = self._turn
        self._turn = (index + 1) % self.instances
        self.submit_to(index, job)

    def submit_to(self, index: int, job: BatchJob) -> None:
        """Run ``job`` on instance ``index``, or inline if it is measured tiny (still
        counted as the instance's: it is the batch of that instance's sequences)."""
        self.batches[index] += 1
        if self._inline_instance is not None:
            key = job.size.bit_length()
            if self._inline.get(key, False) or self._probe_due(key):
                self._run_inline_on_loop(job)
                return
        self._queues[index].put(job)

    def stage_to(self, index: int, job: BatchJob) -> Staged:
        """Stage ``job`` for instance ``index`` (see :meth:`ExecutorPool.stage`)."""
        self.batches[index] += 1
        staged = Staged(job)
        self._queues[index].put(staged)
        return staged

    def _fan_out(self) -> None:
        for view in self._views:
            if view.on_live is not None:
                view.on_live()


class InstanceExecutor:
    """One instance of a :class:`PinnedPool`, as the executor of that instance's batcher.

    The pool is started and stopped by its owner; ``start`` and ``stop`` here do nothing.
    """

    def __init__(self, pool: PinnedPool, index: int) -> None:
        self._pool = pool
        self.index = index
        self.on_live: Callable[[], Any] | None = None

    @property
    def engine(self) -> Engine:
        return self._pool.engine

    @property
    def live(self) -> int:
        return 1 if self._pool.is_live(self.index) else 0

    @property
    def restarts(self) -> int:
        return self._pool.restarts

    async def start(self) -> None:
        return None

    async def stop(self, timeout: float = 10.0) -> None:
        return None

    def submit(self, job: BatchJob) -> None:
        self._pool.submit_to(self.index, job)

    def can_stage(self) -> bool:
        return self._pool.can_stage()

    def stage(self, job: BatchJob) -> Staged:
        return self._pool.stage_to(self.index, job)

    def runs_inline(self, size: int) -> bool:
        return self._pool.runs_inline(size)

    def run_inline(self, job: BatchJob) -> None:
        self._pool.batches[self.index] += 1
        self._pool.run_inline(job)
