"""The one executor thread of a decoder model: it runs the engine's steps.

The continuous batcher (on the loop) submits one :class:`StepJob` at a time:
sequences to free, sequences to prefill, sequences to decode. The thread
frees, steps, and posts the job back through
:func:`aserve.workers.handoff.post_threadsafe`; the job's ``on_done`` then runs
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
from typing import Any

from aserve.engines.decoder import DecoderEngine, Sequence, StepOutput
from aserve.workers.handoff import post_threadsafe

log = logging.getLogger("aserve.executor")


class StepJob:
    """One engine step on its way to the thread and back.

    ``free`` are sequences whose slots go back first (cancelled, expired, or
    left over from a failed step), so a step can reuse them at once. Then
    ``new`` are prefilled and ``running`` decoded; ``outputs`` has one entry
    per sequence of ``new + running``, in that order, unless ``error`` is set
    (``not_run`` too when the step never reached the engine).
    ``tag`` is the submitter's own bookkeeping; the thread never reads it.
    """

    __slots__ = (
        "error",
        "free",
        "infer_ns",
        "new",
        "not_run",
        "on_done",
        "outputs",
        "running",
        "tag",
    )

    def __init__(
        self,
        new: list[Sequence],
        running: list[Sequence],
        free: list[Sequence],
        on_done: Callable[[StepJob], Any],
        tag: Any = None,
    ) -> None:
        self.new = new
        self.running = running
        self.free = free
        self.on_done = on_done
        self.tag = tag
        self.outputs: list[StepOutput] = []
        self.error: BaseException | None = None
        self.not_run = False  # with error: the step never reached the engine
        self.infer_ns = 0


_STOP = object()


class StepExecutor:
    """A thread that runs one :class:`DecoderEngine`'s steps in submission order."""

    def __init__(self, engine: DecoderEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
    def alive(self) -> bool:
        """Steps can be submitted (the thread's queue always takes them)."""
        return True

    def check(self, seq: Sequence) -> None:
        """Whether ``seq`` can be stepped (a thread takes any sequence)."""

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
            log.warning("step thread %s did not stop within %.1fs", self._thread.name, timeout)
        self._thread = None

    # --- executor-thread side -------------------------------------------------

    def _main_threadsafe(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        engine = self.engine
        try:
            engine.create_instance(0)
        except Exception as exc:  # reported to start(), which fails the model load
            post_threadsafe(loop, _settle, ready, exc)
            return
        post_threadsafe(loop, _settle, ready, None)
        perf = time.perf_counter_ns
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
            post_threadsafe(loop, job.on_done, job)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
