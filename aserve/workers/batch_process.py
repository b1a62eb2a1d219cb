"""A batched model's instances in worker processes: the engine gets its own GIL.

Why: a CPU model run from Python (an eager torch module, a handler's
``infer``) is many small native calls, and each gives the GIL up and takes it
back. On an executor thread of the server process every stretch of Python the
event loop runs (parsing requests, answering, refusing under overload) makes
the model wait for the GIL: measured with MiniLM behind a python handler at
3x overload, the loop held the GIL ~45% of the time and batches took 2-3x as
long as the same model alone, which both halved throughput and made the
batch latencies that admission control predicts from swing. In a worker
process the model and the loop run on two cores without meeting.

:class:`ProcessPool` is an :class:`~aserve.workers.job.Executor`, as
:class:`aserve.workers.thread_pool.ExecutorPool` is: the batcher submits
:class:`BatchJob` s only while an instance is free and gets each back through
its ``on_done``, on the loop. One child per instance; each loads the engine
itself (:meth:`Engine.load_worker`, in :func:`aserve.workers.child.batch_main`)
and runs one batch at a time; each child's life (spawn, handshake, restart
with backoff, stop) is its :class:`~aserve.workers.supervisor.Supervisor`'s. A job
crosses its pipe as msgpack (:mod:`aserve.workers.wire`): the requests'
arrays, unstacked, and the child stacks, runs and checks them as an
executor thread would. There is no thread on the server side: the loop
writes the job and reads the answer through the pipe's transport
(:mod:`aserve.workers.pipe`). Layer: ``workers``; everything here runs on the loop.

A child ignores SIGINT/SIGTERM (the server drains first, then stops it) and
exits when its pipe closes, so it never outlives the server. If it dies, its
batch in flight fails, ``live`` (the children that can take a batch) drops
by one and a new child is started with backoff; ``on_live`` hears both
changes. Batches go to the live children meanwhile: the batcher hands out
no more than ``live`` at a time, and the model is not ready only while no
child is up. A batch submitted while no child is free waits in the pool for
one, as queued requests wait for a restarted executor thread; ``stop``
answers whatever is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from aserve.config import GpuConfig, ModelConfig
from aserve.engines.base import Engine
from aserve.workers import supervisor
from aserve.workers.child import WorkerSpec, batch_main
from aserve.workers.job import BatchJob
from aserve.workers.supervisor import Supervisor
from aserve.workers.wire import pack_arrays, unpack_arrays

__all__ = ["ProcessPool", "WorkerError", "WorkerSpec", "start_early", "worker_spec"]

log = logging.getLogger("aserve.executor")


def worker_spec(
    config: ModelConfig, path: Path | None, base_dir: Path, gpu: GpuConfig
) -> WorkerSpec:
    """What each worker process of ``config`` is started with: the model's config,
    its weights' located ``path`` and folder, and the server's "gpu" block. Made
    here for the pool and for :func:`start_early` alike, since a child started
    early is taken over only if its spec is equal."""
    where = None if path is None else str(path)
    return WorkerSpec(config, where, str(base_dir), gpu.model_dump())


def start_early(spec: WorkerSpec, instances: int, name: str) -> None:
    """Start the worker processes of model ``name`` now, for its :class:`ProcessPool`
    to take over if it is made with the same ``spec`` (see :func:`supervisor.start_early`)."""
    for index in range(instances):
        supervisor.start_early(batch_main, (spec, index), _proc_name(name, index))


def _proc_name(name: str, index: int) -> str:
    return f"aserve-{name}-{index}"


class WorkerError(RuntimeError):
    """A worker process failed a batch, died, or is being restarted."""


class _Child:
    __slots__ = ("index", "job", "sup")

    def __init__(self, index: int, sup: Supervisor) -> None:
        self.index = index
        self.sup = sup
        self.job: BatchJob | None = None


class ProcessPool:
    """``instances`` worker processes serving one model, supervised from the loop.

    ``engine`` is the server's side of the model (loaded with
    :meth:`Engine.load_front`): what the rest of the server reads, never run.
    """

    def __init__(self, spec: WorkerSpec, engine: Engine, instances: int, name: str) -> None:
        self.spec = spec
        self.engine = engine
        self.instances = instances
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._waiting: deque[BatchJob] = deque()  # no child free: one is restarting
        self.on_live: Callable[[], Any] | None = None
        self._children = [self._child(i) for i in range(instances)]

    def _child(self, index: int) -> _Child:
        child: _Child
        sup = Supervisor(
            batch_main, (self.spec, index), f"worker process {index} of '{self.name}'",
            _proc_name(self.name, index), WorkerError,
            on_message=lambda payload: self._on_message(child, payload),
            on_lost=lambda reason: self._on_lost(child, reason),
            on_live=lambda: self._on_child_live(child),
        )  # fmt: skip
        child = _Child(index, sup)
        return child

    @property
    def live(self) -> int:
        """Children up and serving (none being restarted)."""
        return sum(1 for c in self._children if c.sup.up)

    @property
    def restarts(self) -> int:
        """Children replaced after dying, all instances together."""
        return sum(c.sup.restarts for c in self._children)

    @property
    def pids(self) -> list[int]:
        """The worker processes now up."""
        return [pid for c in self._children if (pid := c.sup.pid) is not None]

    async def start(self) -> None:
        """Start every child; returns once each has loaded the model (or raises why not).

        Cancelled (the model's front failed to load meanwhile), it stops the
        children already up; those still loading are reaped by their own start.
        """
        self._loop = asyncio.get_running_loop()
        try:
            results = await asyncio.gather(
                *(c.sup.start() for c in self._children), return_exceptions=True
            )
        except asyncio.CancelledError:
            # The gather ends only once every start has ended (reaped its child).
            await self.stop()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    def submit(self, job: BatchJob) -> None:
        """Send a batch to a free child (loop side; ``job.on_done`` is called later, on the loop)."""
        if self._stopping:
            job.error = WorkerError(f"the worker processes of '{self.name}' are stopping")
            self._finish(job)
            return
        child = next((c for c in self._children if c.sup.up and c.job is None), None)
        if child is None:
            self._waiting.append(job)  # until a child frees up or comes back
            return
        self._send(child, job)

    def _feed(self, child: _Child) -> None:
        """Give a free child the oldest waiting batch, if any."""
        if self._waiting and child.sup.up and child.job is None and not self._stopping:
            self._send(child, self._waiting.popleft())

    def _send(self, child: _Child, job: BatchJob) -> None:
        try:
            parts = [pack_arrays(p) for p in job.parts]
            message = msgpack.packb(("batch", parts, job.size))
        except (TypeError, ValueError) as exc:  # what preprocess returned cannot be sent
            job.error = exc
            self._finish(job)
            return
        child.job = job
        channel = child.sup.channel
        assert channel is not None  # the child is up
        try:
            channel.send(message)
        except OSError as exc:  # the child is gone; its supervisor sees the EOF next
            child.job = None
            job.error = WorkerError(f"the worker process of '{self.name}' is gone: {exc}")
            self._finish(job)

    async def stop(self, timeout: float = 10.0) -> None:
        """Let each child finish its batch (answered as usual) and exit."""
        self._stopping = True
        stopped = WorkerError(f"the worker processes of '{self.name}' stopped")
        while self._waiting:
            job = self._waiting.popleft()
            job.error = stopped
            self._finish(job)
        await asyncio.gather(*(c.sup.stop(timeout) for c in self._children))
        for child in self._children:
            job, child.job = child.job, None
            if job is not None:
                job.error = stopped
                self._deliver(job)

    # --- answers, on the loop ------------------------------------------------------

    def _on_message(self, child: _Child, payload: bytes) -> None:
        msg = msgpack.unpackb(payload, use_list=True)
        kind = msg[0]
        if kind == "fatal":  # it is dying: the supervisor's exit reason says why
            child.sup.fatal = msg[1]
        elif kind == "ready":
            self._take_metrics(msg, 1)
        else:
            self._take_metrics(msg, 4 if kind == "ok" else 2)
            self._answer(child, msg)

    def _take_metrics(self, msg: list[Any], at: int) -> None:
        """A handler's custom metrics updates, sent after a message's own fields."""
        metrics = getattr(self.engine, "metrics", None)
        if len(msg) > at and msg[at] is not None and metrics is not None:
            metrics.apply(msg[at])

    def _answer(self, child: _Child, msg: list[Any]) -> None:
        job, child.job = child.job, None
        if job is None:
            log.error("worker process of '%s' answered with no batch in flight", self.name)
            return
        try:
            if msg[0] == "ok":
                # Writable copies: a postprocess may change its outputs in place, as
                # it can with threads.
                job.outputs = unpack_arrays(msg[1], writable=True)
                job.input_ns, job.infer_ns = msg[2], msg[3]
            else:
                job.error = WorkerError(msg[1])
        except Exception as exc:  # a malformed answer fails its batch, not the child
            job.outputs, job.error = None, WorkerError(f"unreadable answer: {exc!r}")
        self._feed(child)  # a batch that waited goes first, before on_done submits more
        self._deliver(job)

    def _deliver(self, job: BatchJob) -> None:
        try:
            job.on_done(job)
        except Exception:  # never into the transport: it would close a healthy child's pipe
            log.exception("answering a batch of '%s' failed", self.name)

    def _finish(self, job: BatchJob) -> None:
        assert self._loop is not None
        # Never re-enter the batcher from inside its own submit().
        self._loop.call_soon(job.on_done, job)

    def _on_lost(self, child: _Child, reason: str) -> None:
        """The child died (and was reaped): its batch in flight fails with how it ended."""
        job, child.job = child.job, None
        if job is not None:
            job.error = WorkerError(reason)
            self._deliver(job)

    def _on_child_live(self, child: _Child) -> None:
        self._feed(child)  # a child back takes a waiting batch (a no-op while it is down)
        if self.on_live is not None:
            self.on_live()
