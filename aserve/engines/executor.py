"""Executor threads: the instances of one model on its device.

The loop submits a :class:`BatchJob`; whichever instance thread is free takes
it, stacks the inputs, runs the engine and posts the outcome back through
:func:`aserve.loop.handoff.post_threadsafe`. The batcher only submits while
it knows an instance is free, so jobs never pile up in the thread queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aserve.engines.base import Engine
from aserve.loop.handoff import post_threadsafe

log = logging.getLogger("aserve.executor")


class BatchJob:
    """One batch on its way to an instance thread and back.

    ``on_done(job)`` is called on the loop after the thread filled in either
    ``outputs`` or ``error`` and the timings. ``tag`` is the submitter's own
    bookkeeping; the thread never reads it.
    """

    __slots__ = ("error", "infer_ns", "input_ns", "on_done", "outputs", "parts", "size", "tag")

    def __init__(
        self,
        parts: Sequence[dict[str, np.ndarray]],
        size: int,
        on_done: Callable[[BatchJob], Any],
        tag: Any = None,
    ) -> None:
        self.parts = parts
        self.size = size
        self.on_done = on_done
        self.tag = tag
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.input_ns = 0
        self.infer_ns = 0


_STOP = object()


class ExecutorPool:
    """``instances`` threads serving one engine."""

    def __init__(self, engine: Engine, instances: int, name: str) -> None:
        self.engine = engine
        self.instances = instances
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start the instance threads; returns once each has created its instance state."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        ready = [loop.create_future() for _ in range(self.instances)]
        for index, fut in enumerate(ready):
            t = threading.Thread(
                target=self._main_threadsafe,
                args=(index, fut),
                name=f"aserve-{self.name}-{index}",
                daemon=True,  # a model stuck in native code must not keep the process alive
            )
            t.start()
            self._threads.append(t)
        await asyncio.gather(*ready)

    def submit(self, job: BatchJob) -> None:
        """Hand a batch to the next free instance (loop side, never blocks)."""
        self._jobs.put(job)

    async def stop(self, timeout: float = 10.0) -> None:
        """Let the threads finish their current batch and exit."""
        for _ in self._threads:
            self._jobs.put(_STOP)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            await asyncio.to_thread(t.join, max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("executor thread %s did not stop within %.1fs", t.name, timeout)
        self._threads.clear()

    # --- executor-thread side -------------------------------------------------

    def _main_threadsafe(self, index: int, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            instance = self.engine.create_instance(index)
        except Exception as exc:  # reported to start(), which fails the model load
            post_threadsafe(loop, _settle, ready, exc)
            return
        post_threadsafe(loop, _settle, ready, None)

        stack, check = self.engine.stack_inputs, self.engine.check_outputs
        perf = time.perf_counter_ns
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            t0 = perf()
            try:
                inputs = stack(job.parts)
                t1 = perf()
                outputs = self.engine.run(inputs, instance)
                t2 = perf()
                check(outputs, job.size)
                job.outputs = outputs
                job.input_ns, job.infer_ns = t1 - t0, t2 - t1
            except Exception as exc:
                job.error = exc
            post_threadsafe(loop, job.on_done, job)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
