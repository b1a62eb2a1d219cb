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

:class:`ProcessPool` has the interface of
:class:`aserve.workers.thread_pool.ExecutorPool`: the batcher submits
:class:`BatchJob` s only while an instance is free and gets each back through
its ``on_done``, on the loop. One child per instance; each loads the engine
itself (:meth:`Engine.load_worker`) and runs one batch at a time. A job
crosses its pipe as msgpack (:mod:`aserve.workers.wire`): the requests'
arrays, unstacked, and the child stacks, runs and checks them as an
executor thread would. There is no thread on the server side: the loop
writes the job and reads the answer through the pipe's transport
(:mod:`aserve.workers.pipe`).

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
import dataclasses
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.engines.gpu_memory import CacheReleaser
from aserve.workers import supervisor
from aserve.workers.pipe import PipeChannel, open_channel
from aserve.workers.thread_pool import BatchJob
from aserve.workers.wire import pack_arrays, unpack_arrays

log = logging.getLogger("aserve.executor")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a child needs to build and load the same engine as the server's."""

    config: ModelConfig
    model_path: str | None
    base_dir: str
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)  # the server's "gpu" block


class WorkerError(RuntimeError):
    """A worker process failed a batch, died, or is being restarted."""


class _Child:
    __slots__ = ("channel", "fatal", "index", "job", "proc", "up")

    def __init__(self, index: int, proc: multiprocessing.process.BaseProcess):
        self.index = index
        self.proc = proc
        self.channel: PipeChannel | None = None
        self.job: BatchJob | None = None
        self.up = False
        self.fatal = ""  # what the child said killed it, if it could


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
        self._children: dict[int, _Child] = {}
        self._stopping = False
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._exited: dict[int, _Child] = {}  # dead, their batch not answered yet
        self._waiting: deque[BatchJob] = deque()  # no child free: one is restarting
        self.restarts = 0
        self.on_live: Callable[[], Any] | None = None

    @property
    def live(self) -> int:
        """Children up and serving (none being restarted)."""
        return sum(1 for c in self._children.values() if c.up)

    @property
    def pids(self) -> list[int]:
        """The worker processes now up."""
        return [c.proc.pid for c in self._children.values() if c.up and c.proc.pid is not None]

    async def start(self) -> None:
        """Start every child; returns once each has loaded the model (or raises why not)."""
        self._loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(self._spawn(i) for i in range(self.instances)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    async def _spawn(self, index: int) -> None:
        loop = self._loop
        assert loop is not None
        proc, parent = supervisor.start(
            worker_main, (self.spec, index), f"aserve-{self.name}-{index}"
        )
        child = _Child(index, proc)
        ready: asyncio.Future[None] = loop.create_future()
        try:
            child.channel = await open_channel(
                parent,
                lambda payload: self._on_message(child, ready, payload),
                lambda: self._on_exit(child, ready),
            )
        except BaseException:
            parent.close()
            await asyncio.to_thread(supervisor.reap, proc, 5.0)  # it exits on EOF
            raise
        try:
            await ready
        except BaseException:
            self._close(child)
            await asyncio.to_thread(supervisor.reap, proc, 5.0)
            raise
        if self._stopping:
            self._close(child)
            await asyncio.to_thread(supervisor.reap, proc, 5.0)
            return
        child.up = True
        self._children[index] = child
        # The pid in the log lets an operator (and a test) find, signal or profile one worker.
        log.info("worker process %d of '%s' is up (pid %d)", index, self.name, proc.pid)
        self._feed(child)

    def submit(self, job: BatchJob) -> None:
        """Send a batch to a free child (loop side; ``job.on_done`` is called later, on the loop)."""
        if self._stopping:
            job.error = WorkerError(f"the worker processes of '{self.name}' are stopping")
            self._finish(job)
            return
        child = next((c for c in self._children.values() if c.up and c.job is None), None)
        if child is None:
            self._waiting.append(job)  # until a child frees up or comes back
            return
        self._send(child, job)

    def _feed(self, child: _Child) -> None:
        """Give a free child the oldest waiting batch, if any."""
        if self._waiting and child.up and child.job is None and not self._stopping:
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
        try:
            assert child.channel is not None
            child.channel.send(message)
        except OSError as exc:  # the child is gone; _on_readable sees the EOF next
            child.job = None
            job.error = WorkerError(f"the worker process of '{self.name}' is gone: {exc}")
            self._finish(job)

    async def stop(self, timeout: float = 10.0) -> None:
        """Let each child finish its batch (answered as usual) and exit."""
        self._stopping = True
        restarts = list(self._restarts.values())
        for task in restarts:
            task.cancel()
        # A replacement being started reaps what it started before it ends.
        await asyncio.gather(*restarts, return_exceptions=True)
        stopped = WorkerError(f"the worker processes of '{self.name}' stopped")
        for child in list(self._exited.values()):
            self._fail_exited(child, f"the worker process {child.index} of '{self.name}' exited")
        while self._waiting:
            job = self._waiting.popleft()
            job.error = stopped
            self._finish(job)
        children = list(self._children.values())
        self._children.clear()
        for child in children:
            try:
                if child.channel is not None:
                    child.channel.send(msgpack.packb(("stop",)))
            except OSError:
                pass
        await asyncio.gather(
            *(asyncio.to_thread(supervisor.reap, c.proc, timeout) for c in children)
        )
        for child in children:
            # The channel stays open until the child's end closes, so that the
            # answer to its last batch, written before it exited, is read.
            if child.channel is not None:
                try:
                    await asyncio.wait_for(child.channel.wait_closed(), 1.0)
                except asyncio.TimeoutError:
                    pass
            self._close(child)
            job, child.job = child.job, None
            if job is not None:
                job.error = stopped
                self._deliver(job)

    # --- answers, on the loop ------------------------------------------------------

    def _on_message(self, child: _Child, ready: asyncio.Future[None], payload: bytes) -> None:
        msg = msgpack.unpackb(payload, use_list=True)
        kind = msg[0]
        if kind == "fatal":
            child.fatal = msg[1]
        elif kind == "ready":
            self._take_metrics(msg, 1)
            if not ready.done():
                ready.set_result(None)
        elif kind == "load_error":
            if not ready.done():
                ready.set_exception(WorkerError(msg[1]))
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

    def _on_exit(self, child: _Child, ready: asyncio.Future[None]) -> None:
        self._close(child)
        if not ready.done():  # died while loading: _spawn raises
            ready.set_exception(WorkerError(self._exit_reason(child)))
            return
        if self._stopping or self._children.get(child.index) is not child:
            return
        del self._children[child.index]
        self._exited[child.index] = child
        self._live_changed()
        self._restarts[child.index] = asyncio.ensure_future(self._restart(child))

    def _fail_exited(self, child: _Child, reason: str) -> None:
        self._exited.pop(child.index, None)
        job, child.job = child.job, None
        if job is not None:
            job.error = WorkerError(reason)
            self._deliver(job)

    def _exit_reason(self, child: _Child) -> str:
        code = child.proc.exitcode
        return (
            f"the worker process {child.index} of '{self.name}' exited"
            + (f" (exit code {code})" if code is not None else "")
            + (f": {child.fatal}" if child.fatal else "")
        )

    def _close(self, child: _Child) -> None:
        child.up = False
        if child.channel is not None:
            child.channel.close()

    async def _restart(self, old: _Child) -> None:
        index = old.index
        # Reaped first, so that the error of its batch in flight can say how it ended.
        await asyncio.to_thread(supervisor.reap, old.proc, 5.0)
        reason = self._exit_reason(old)
        log.error("%s; restarting it", reason)
        self._fail_exited(old, reason)
        for attempt in range(10_000):
            if self._stopping:
                return
            try:
                await self._spawn(index)
            except Exception as exc:
                log.error("restarting worker process %d of '%s' failed: %s", index, self.name, exc)
                await asyncio.sleep(supervisor.restart_delay(attempt))
                continue
            if self._stopping:
                return
            self.restarts += 1
            self._restarts.pop(index, None)
            log.warning("worker process %d of '%s' is back (restart %d)", index, self.name,
                        self.restarts)  # fmt: skip
            self._live_changed()
            return

    def _live_changed(self) -> None:
        if self.on_live is not None:
            self.on_live()


# --- the child ---------------------------------------------------------------------------


def worker_main(conn: Connection, spec: WorkerSpec, index: int) -> None:
    """The child's whole life: load, then run batches until told to stop or the pipe closes."""
    try:
        releaser = supervisor.settle_child(spec.config.device, spec.gpu)
        engine = worker_engine(spec)
        engine.load_worker()
        instance = engine.create_instance(index)
    except Exception as exc:
        conn.send_bytes(msgpack.packb(("load_error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(msgpack.packb(("ready", _drain(engine))))
    try:
        _serve(conn, engine, instance, releaser)
    except (EOFError, OSError):
        pass  # the server has gone


def worker_engine(spec: WorkerSpec) -> Engine:
    """The engine of ``spec``, built as the server builds it (loads nothing yet)."""
    path = Path(spec.model_path) if spec.model_path is not None else None
    if spec.config.engine == "python":
        from aserve.engines.python_handler import PythonHandlerEngine

        return PythonHandlerEngine(spec.config, path, Path(spec.base_dir))
    from aserve.engines import create_engine

    assert path is not None
    return create_engine(spec.config, path)


def _serve(conn: Connection, engine: Engine, instance: Any, releaser: CacheReleaser | None) -> None:
    perf = time.perf_counter_ns
    while True:
        msg = msgpack.unpackb(conn.recv_bytes(), use_list=True)
        if msg[0] == "stop":
            return
        _, packed_parts, size = msg
        try:
            t0 = perf()
            parts = [unpack_arrays(p, writable=True) for p in packed_parts]
            inputs = engine.stack_inputs(parts)
            t1 = perf()
            outputs = engine.run(inputs, instance)
            t2 = perf()
            engine.check_outputs(outputs, size)
            answer = msgpack.packb(("ok", pack_arrays(outputs), t1 - t0, t2 - t1, _drain(engine)))
        except Exception as exc:  # this batch fails; the child serves the next
            answer = msgpack.packb(("error", str(exc) or type(exc).__name__, _drain(engine)))
        except BaseException as exc:  # SystemExit & co.: the child ends; say why first
            conn.send_bytes(msgpack.packb(("fatal", f"{type(exc).__name__}: {exc}")))
            raise
        conn.send_bytes(answer)
        if releaser is not None:
            releaser.maybe()  # after answering: the release is off the batch's latency


def _drain(engine: Engine) -> Any:
    """What a handler's custom metrics changed since the last answer (None: nothing)."""
    metrics = getattr(engine, "metrics", None)
    return None if metrics is None else metrics.drain()
