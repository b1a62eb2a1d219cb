"""The one executor thread of a decoder model: it runs the engine's steps.

Layer: ``workers``. ``start``/``submit``/``stop`` run on the loop; the
thread's side (``_main_threadsafe``) runs on its own thread.

The continuous batcher (on the loop) submits one :class:`StepJob` at a time:
sequences to free, sequences to prefill, sequences to decode. The thread
frees, steps, and posts the job back through
:mod:`aserve.workers.handoff`; the job's ``on_done`` then runs
on the loop. The thread owns the engine's KV cache and every started
sequence, and never touches an asyncio object.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aserve.workers.handoff import poster, settle_threadsafe
from aserve.workers.job import StepJob
from aserve.workers.offload import leave_behind

if TYPE_CHECKING:
    from aserve.engines.decoder import DecoderEngine

log = logging.getLogger("aserve.executor")


_STOP = object()


class StepExecutor:
    """A thread that runs one :class:`DecoderEngine`'s steps in submission order.

    An :class:`~aserve.workers.job.Executor` and an
    :class:`~aserve.workers.job.EngineHandle`. It takes any sequence (no
    :class:`~aserve.workers.job.SequenceCheck`) and never runs a step unasked
    (no :class:`~aserve.workers.job.RunAhead`): handing a step back costs a
    thread switch, not a pipe's round trip.
    """

    def __init__(self, engine: DecoderEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.restarts = 0  # a step thread is never replaced
        self.on_live: Callable[[], Any] | None = None  # never called: ``live`` stays 1

    async def start(self) -> None:
        """Start the thread; returns once it has set itself up for the engine."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        ready: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._main_threadsafe,
            args=(ready,),
            name=f"aserve-{self.name}-steps",
            daemon=True,  # a model stuck in native code must not keep the process alive
        )
        self._thread.start()
        await ready

    @property
    def live(self) -> int:
        """1: steps can be submitted (the thread's queue always takes them)."""
        return 1

    def submit(self, job: StepJob) -> None:
        """Queue a step (loop side, never blocks)."""
        self._jobs.put(job)

    async def stop(self, timeout: float = 10.0) -> None:
        """Let the thread finish its current step and exit."""
        if self._thread is None:
            return
        self._jobs.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.warning(
                "step thread %s did not stop within %.1fs: left running", self._thread.name,
                timeout,
            )  # fmt: skip
            leave_behind(self._thread, f"the step thread of model '{self.name}', in a step")
        self._thread = None

    # --- executor-thread side -------------------------------------------------

    def _main_threadsafe(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        engine = self.engine
        try:
            engine.create_instance(0)
        except Exception as exc:  # reported to start(), which fails the model load
            settle_threadsafe(loop, ready, exc)
            return
        settle_threadsafe(loop, ready, None)
        perf = time.perf_counter_ns
        post = poster(loop)
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                for seq in job.free:
                    engine.free(seq)
                t0 = perf()
                job.outputs = engine.step(job.new, job.running)
                job.infer_ns = perf() - t0
            except Exception as exc:
                job.error = exc
            try:
                post(job.on_done, job)
            except RuntimeError:  # the loop has closed: nothing is left to answer
                return
