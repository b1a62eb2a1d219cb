"""Executor threads: the instances of one model on its device.

Layer: ``workers``. The pool's ``start``/``submit``/``stop`` and its
supervision run on the loop; each instance's ``_main_threadsafe`` on its
own thread, which reaches the loop only through :mod:`.handoff`; and a tiny
batch may run inline, on the loop's own thread (below).

The loop submits a :class:`BatchJob`; whichever instance thread is free takes
it, stacks the inputs, runs the engine and posts the outcome back through
:mod:`aserve.workers.handoff`. The batcher only submits while
it knows an instance is free, so jobs never pile up in the thread queue,
but for one: while every instance is busy, the batcher may stage the next
batch (:meth:`ExecutorPool.stage`), which waits in the queue for the first
instance that frees up, so that the model does not wait for the loop's turn
between batches (:class:`aserve.workers.job.Staged`).

**Inline on the loop.** Tiny batches run on the loop instead
(:meth:`ExecutorPool._run_inline_on_loop`). Handing a batch to a thread and back
costs ~0.1-0.25 ms of wake-ups (and GIL hand-overs), several times what a
tiny CPU model takes to run: the plain handler that calls such a model per
request answers faster than any batcher that uses threads. So for an engine
that allows it (``inline_capable``: torch on the CPU), the pool keeps the
last few stack+run times of each batch-size class, and runs a batch of a
class whose second-smallest time is under :data:`INLINE_MAX_NS` (DESIGN:
nothing over ~100 µs on the loop) right there, answering it through
``call_soon``. A model that turns slower goes back to the threads by the
same measure. A request that finds the model idle goes further: the batcher
runs it through :meth:`ExecutorPool.run_inline` inside its ``submit`` and
answers it before that returns (the idle fast path, see
:class:`aserve.workers.job.Inline`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aserve.engines.base import Engine
from aserve.workers.handoff import post_threadsafe, poster, settle_threadsafe
from aserve.workers.job import BatchJob, Staged
from aserve.workers.offload import leave_behind

log = logging.getLogger("aserve.executor")


_STOP = object()

# A batch measured faster than this runs on the loop (DESIGN's ~100 µs). Times
# measured on an instance thread run ~2.5x those of the same call on the loop
# (a thread woken for each batch starts cold: 75 vs 29 µs for y = x + 1), so a
# tiny model enters at this bound and then stays well under it.
INLINE_MAX_NS = 100_000
_COST_WINDOW = 8  # the thread runs of a size class that decide; none inline before
# Times on a thread are upper bounds: at load the thread waits for the GIL between
# torch calls while the loop is busy, and a model measured 0.1-5 ms there ran in
# 40 µs on the loop. So a size class kept on the threads whose fastest recent run
# there was under _PROBE_MAX_NS runs one batch in _PROBE_EVERY on the loop, and that
# run's time says what the loop would spend (a probe costs the loop at most about
# _PROBE_MAX_NS, once per _PROBE_EVERY batches of the class).
_PROBE_MAX_NS = 1_000_000
_PROBE_EVERY = 64
_LOOP_WINDOW = 3  # the loop runs of a size class whose median decides, once that many ran


class ExecutorPool:
    """``instances`` threads serving one engine, supervised from the loop.

    A thread that dies (a ``BaseException`` from the engine, such as
    ``SystemExit``, or anything escaping its loop) tells the loop, answers
    its batch in flight with that error, and exits; the loop starts a
    replacement, which creates its instance state afresh. The threads share
    one queue, so batches go to the live ones meanwhile: ``live`` counts the
    instances that can take a batch, and the model is not ready only while
    it is 0. ``on_live`` (set by the owner) is called on the loop each time
    ``live`` changes.
    """

    def __init__(self, engine: Engine, instances: int, name: str) -> None:
        self.engine = engine
        self.instances = instances
        self.name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: dict[int, threading.Thread] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down: set[int] = set()  # instances whose thread died and is not back yet
        self._stopping = False
        self.restarts = 0
        self.on_live: Callable[[], Any] | None = None
        self._inline_instance: Any = None  # created on the loop's thread, if the engine allows
        # Per batch-size class (bit length): the last stack+run times (ns) on the
        # threads and on the loop, the batches since a probe, and the verdict.
        self._costs: dict[int, deque[int]] = {}
        self._loop_costs: dict[int, deque[int]] = {}
        self._since_probe: dict[int, int] = {}
        self._inline: dict[int, bool] = {}
        self.inline_batches = 0

    @property
    def live(self) -> int:
        """Instances whose thread runs (none of them being restarted)."""
        return self.instances - len(self._down)

    async def start(self) -> None:
        """Start the instance threads; returns once each has created its instance state."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._spawn(index) for index in range(self.instances)))
        if self.engine.inline_capable:
            self._inline_instance = self.engine.create_instance(0)

    def _spawn(self, index: int) -> asyncio.Future[None]:
        """Start the thread of instance ``index``; the future settles once it is ready."""
        assert self._loop is not None
        ready: asyncio.Future[None] = self._loop.create_future()
        t = threading.Thread(
            target=self._main_threadsafe,
            args=(index, ready),
            name=f"aserve-{self.name}-{index}",
            daemon=True,  # a model stuck in native code must not keep the process alive
        )
        self._threads[index] = t
        t.start()
        return ready

    def submit(self, job: BatchJob) -> None:
        """Hand a batch to the next free instance thread, or, if it is tiny, run it
        inline on the loop (loop side; either way ``job.on_done`` is called later,
        on the loop)."""
        if self._inline_instance is not None:
            key = job.size.bit_length()
            if self._inline.get(key, False) or self._probe_due(key):
                self._run_inline_on_loop(job)
                return
        self._jobs.put(job)

    def _probe_due(self, key: int) -> bool:
        """Whether the next batch of size class ``key``, kept on the threads, is the
        one in :data:`_PROBE_EVERY` that runs on the loop to measure it there."""
        costs = self._costs.get(key)
        if costs is None or len(costs) < _COST_WINDOW or min(costs) >= _PROBE_MAX_NS:
            return False
        count = self._since_probe.get(key, 0) + 1
        self._since_probe[key] = 0 if count >= _PROBE_EVERY else count
        return count >= _PROBE_EVERY

    def runs_inline(self, size: int) -> bool:
        """Whether a batch of ``size`` is measured tiny enough to run on the loop."""
        return self._inline_instance is not None and self._inline.get(size.bit_length(), False)

    def run_inline(self, job: BatchJob) -> None:
        """Run ``job`` here and now, on the loop (``runs_inline`` said yes), and learn
        its cost; the caller answers it (``on_done`` is not called)."""
        _run(self.engine, job, self._inline_instance)
        self.inline_batches += 1
        self._learn(job, on_loop=True)

    def can_stage(self) -> bool:
        """Whether a batch should wait staged for a thread: not while some batch
        sizes run inline (a model that fast waits for no loop turn worth saving)."""
        return self._inline_instance is None or not any(self._inline.values())

    def stage(self, job: BatchJob) -> Staged:
        """Queue ``job`` for the first instance thread that frees up; the loop may
        still change it or take it back through what this returns."""
        staged = Staged(job)
        self._jobs.put(staged)
        return staged

    def _run_inline_on_loop(self, job: BatchJob) -> None:
        """Stack, run and check ``job`` here, on the loop's thread, with the instance
        created there: batch-size classes measured under :data:`INLINE_MAX_NS`
        come here, and the probes of :meth:`_probe_due`. Answered through
        ``call_soon``, never from inside ``submit``."""
        assert self._loop is not None
        _run(self.engine, job, self._inline_instance)
        self.inline_batches += 1
        self._loop.call_soon(self._finished, job, True)

    def _finished(self, job: BatchJob, on_loop: bool = False) -> None:
        """Every batch comes back here (on the loop): learn its cost, then answer it."""
        self._learn(job, on_loop)
        job.on_done(job)

    def _learn(self, job: BatchJob, on_loop: bool) -> None:
        """Note the stack+run time of a finished batch (``on_loop``: it ran there):
        whether its size class runs inline."""
        if job.error is not None or self._inline_instance is None:
            return
        key = job.size.bit_length()
        cost = job.input_ns + job.infer_ns
        if on_loop:
            # What the loop really spends: the median of its last few runs decides;
            # until there are that many, a tiny run puts the class on the loop (a
            # probe) and a slow one (a cold first run) takes nothing off it.
            runs = self._loop_costs.get(key)
            if runs is None:
                runs = self._loop_costs[key] = deque(maxlen=_LOOP_WINDOW)
            runs.append(cost)
            if len(runs) == _LOOP_WINDOW:
                self._inline[key] = sorted(runs)[_LOOP_WINDOW // 2] < INLINE_MAX_NS
            elif cost < INLINE_MAX_NS:
                self._inline[key] = True
            return
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = deque(maxlen=_COST_WINDOW)
        costs.append(cost)
        if len(costs) == _COST_WINDOW and not self._inline.get(key, False):
            # The second smallest: a first run's warm-up or a preempted run does
            # not decide. Runs on a thread that waited for the GIL between torch
            # calls while the loop was busy (most of them, at load) keep a tiny
            # model off the loop here; the probes put it back (_probe_due).
            self._inline[key] = sorted(costs)[1] < INLINE_MAX_NS

    async def stop(self, timeout: float = 10.0) -> None:
        """Let the threads finish their current batch and exit; one still running
        after ``timeout`` (a batch that never ends) is left running, and noted
        (:func:`~aserve.workers.offload.leave_behind`)."""
        self._stopping = True
        threads = list(self._threads.items())
        self._send_stops(len(threads))
        deadline = time.monotonic() + timeout
        for index, t in threads:
            await asyncio.to_thread(t.join, max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning(
                    "executor thread %s did not stop within %.1fs: left running", t.name, timeout
                )
                leave_behind(t, f"instance {index} of model '{self.name}', in a batch")
        self._threads.clear()

    def _send_stops(self, threads: int) -> None:
        """Tell ``threads`` instance threads to exit once their current batch is done."""
        for _ in range(threads):
            self._jobs.put(_STOP)

    def _queue_of(self, index: int) -> queue.SimpleQueue[Any]:
        """The queue instance ``index`` takes its jobs from: the one they all share."""
        return self._jobs

    # --- supervision (on the loop) ----------------------------------------------

    def _on_thread_died(self, index: int, error: BaseException) -> None:
        self._down.add(index)
        self._threads.pop(index, None)
        if self._stopping:
            # It took a _STOP meant for itself with it; a thread still waiting
            # for one would wait forever.
            self._queue_of(index).put(_STOP)
            return
        log.error("executor thread %d of '%s' died (%r); restarting it", index, self.name, error)
        self._live_changed()
        self.restarts += 1
        self._spawn(index).add_done_callback(lambda fut: self._on_restarted(index, fut))

    def _on_restarted(self, index: int, fut: asyncio.Future[None]) -> None:
        error = fut.exception()
        if error is not None:
            # The instance cannot be created again: the model stays not ready.
            log.error("executor thread %d of '%s' cannot restart: %r", index, self.name, error)
            return
        if self._stopping:
            return
        self._down.discard(index)
        log.info("executor thread %d of '%s' is back", index, self.name)
        self._live_changed()

    def _live_changed(self) -> None:
        if self.on_live is not None:
            self.on_live()

    # --- executor-thread side -------------------------------------------------

    def _main_threadsafe(self, index: int, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            instance = self.engine.create_instance(index)
        except BaseException as exc:  # reported to start(), which fails the model load
            if not isinstance(exc, Exception):  # never re-raise SystemExit & co. on the loop
                exc = RuntimeError(f"creating instance {index} raised {exc!r}")
            settle_threadsafe(loop, ready, exc)
            return
        settle_threadsafe(loop, ready, None)

        engine = self.engine
        post = poster(loop)
        jobs = self._queue_of(index)
        job: Any = None
        try:
            while True:
                job = jobs.get()
                if job is _STOP:
                    return
                if type(job) is Staged:
                    job = job.take()
                    if job is None:  # taken back by the loop
                        continue
                _run(engine, job, instance)
                try:
                    post(self._finished, job)
                except RuntimeError:  # the loop has closed: nothing is left to answer
                    return
                job = None
        except BaseException as exc:  # the thread dies: tell the loop, then answer its batch
            # In this order, so that the batcher, answered, counts this instance out.
            post_threadsafe(loop, self._on_thread_died, index, exc)
            if isinstance(job, BatchJob):
                job.outputs = None
                job.error = exc
                post_threadsafe(loop, job.on_done, job)


def _run(engine: Engine, job: BatchJob, instance: Any) -> None:
    """Stack, run and check one batch, filling in its outputs or its error."""
    perf = time.perf_counter_ns
    t0 = perf()
    try:
        inputs = engine.stack_inputs(job.parts)
        t1 = perf()
        outputs = engine.run(inputs, instance)
        t2 = perf()
        engine.check_outputs(outputs, job.size)
        job.outputs = outputs
        job.input_ns, job.infer_ns = t1 - t0, t2 - t1
    except Exception as exc:
        job.error = exc
