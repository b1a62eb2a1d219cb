"""A decoder model's steps in a child process: the engine gets its own GIL.

Why a process: a decode step is hundreds of small torch calls, and each one
gives the GIL up and takes it back. With the steps on a thread of the server
process, every stretch of Python the event loop runs (parsing requests,
encoding and writing a token chunk for each stream) makes the step wait for
the GIL; at 32 streams the steps ran ~20% slower than the same engine alone.
In a child process the steps and the loop run on two cores without meeting.

The parent keeps the engine's front (tokenizer and model shape, see
:meth:`DecoderEngine.load_front`) to validate and build sequences on the
loop. :class:`ProcessStepExecutor` has the interface of
:class:`aserve.workers.step_executor.StepExecutor`: the continuous batcher
submits one :class:`StepJob` at a time and gets it back through its
``on_done``, on the loop. The job crosses a pipe as msgpack: new sequences
as their validated settings (the child rebuilds them with
:meth:`DecoderEngine.build_sequence`), the others by a key; outputs come back
as plain fields. There is no thread on the parent side: the loop writes the
request and reads the answer through the pipe's transport
(:mod:`aserve.workers.pipe`).

The child owns the weights, the KV cache and every started sequence. It
ignores SIGINT/SIGTERM (the server drains first, then stops it) and exits
when the pipe closes, so it never outlives the server. If it dies, the step
in flight fails, every sequence it held is ended (``on_lost``), and a new
child is started; until it is up, :attr:`ProcessStepExecutor.alive` is False
(the model reports not ready), the batcher submits no step and its waiting
sequences stay queued, and ``on_back`` tells it when the new child is up.
A step submitted anyway fails with ``not_run`` set: it never reached a child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from aserve.config import GenerationConfig
from aserve.engines.decoder import DecoderEngine, SamplingParams, Sequence, StepOutput
from aserve.engines.gpu_memory import CacheReleaser
from aserve.errors import InvalidArgument
from aserve.workers import supervisor
from aserve.workers.pipe import PipeChannel, open_channel
from aserve.workers.step_executor import StepJob

log = logging.getLogger("aserve.executor")


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """What the child needs to load the same engine as the parent's front."""

    model_path: str
    generation: dict[str, Any]
    device: str
    dtype: str
    cpu_threads: int
    name: str
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)  # the "gpu" block


class StepProcessError(RuntimeError):
    """The step process failed a step, died, or is being restarted."""


class ProcessStepExecutor:
    """Runs one decoder engine's steps in a child process, in submission order."""

    def __init__(
        self,
        args: WorkerArgs,
        on_lost: Callable[[BaseException], None],
        on_back: Callable[[], None] | None = None,
    ) -> None:
        self.args = args
        self.name = args.name
        self._on_lost = on_lost
        self._on_back = on_back
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._channel: PipeChannel | None = None
        self._starting: asyncio.Future[None] | None = None  # until "ready" or a load error
        self._up = False
        self._job: StepJob | None = None
        self._keys: dict[Sequence, int] = {}  # parent sequence -> the child's key
        self._next_key = 0
        self._stopping = False
        self._restart: asyncio.Task[None] | None = None
        self.restarts = 0

    @property
    def alive(self) -> bool:
        """A child is up and answering (False while one is being restarted)."""
        return self._up

    @property
    def pid(self) -> int | None:
        """The child's process id while one is up."""
        return self._proc.pid if self._up and self._proc is not None else None

    async def start(self) -> None:
        """Start the child; returns once it has loaded the model (or raises why not)."""
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        loop = self._loop
        assert loop is not None
        self._starting = starting = loop.create_future()
        proc, parent = supervisor.start(worker_main, (self.args,), f"aserve-{self.name}-steps")
        self._proc = proc
        self._channel = await open_channel(parent, self._on_message, self._on_exit)
        try:
            await starting
        except BaseException:
            self._drop_child()
            await asyncio.to_thread(supervisor.reap, proc, 5.0)
            raise
        finally:
            self._starting = None
        self._up = True

    def submit(self, job: StepJob) -> None:
        """Send a step to the child (loop side, never waits for it)."""
        channel = self._channel
        if channel is None or not self.alive:
            job.error = StepProcessError(f"the step process of '{self.name}' is restarting")
            job.not_run = True
            self._finish(job)
            return
        free = [k for k in (self._keys.pop(s, None) for s in job.free) if k is not None]
        new = []
        for s in job.new:
            key = self._next_key
            self._next_key += 1
            self._keys[s] = key
            new.append(_wire_spec(key, s))
        running = [self._keys[s] for s in job.running]
        try:
            payload = msgpack.packb(("step", free, new, running))
        except (TypeError, ValueError, OverflowError) as exc:
            # check() refuses such a sequence before it is queued; should one
            # still get here, its step fails (every member) instead of leaving
            # the batcher waiting for an answer that never comes.
            for s in job.new:
                self._keys.pop(s, None)
            job.error = StepProcessError(f"a step of '{self.name}' cannot be sent: {exc}")
            self._finish(job)
            return
        self._job = job
        try:
            channel.send(payload)
        except OSError as exc:  # the child is gone; _on_exit follows when the EOF is read
            self._job = None
            self._up = False  # no more steps for it: the batcher waits for on_back
            for s in job.new:
                self._keys.pop(s, None)
            job.error = StepProcessError(f"the step process of '{self.name}' is gone: {exc}")
            job.not_run = True
            self._finish(job)

    def check(self, seq: Sequence) -> None:
        """Refuse (InvalidArgument) a sequence that cannot cross the pipe, before
        it is queued: found at ``submit``, it would fail its whole step."""
        try:
            msgpack.packb(_wire_spec(0, seq))
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(
                f"the request cannot be sent to the step process: {exc}"
            ) from None

    async def stop(self, timeout: float = 10.0) -> None:
        """Let the child finish its current step and exit."""
        self._stopping = True
        if self._restart is not None:
            self._restart.cancel()
        proc, channel = self._proc, self._channel
        if channel is not None:
            try:
                channel.send(msgpack.packb(("stop",)))
            except OSError:
                pass
        self._drop_child()  # closes the channel once what was queued is written
        if proc is not None:
            await asyncio.to_thread(supervisor.reap, proc, timeout)

    # --- answers, on the loop ------------------------------------------------------

    def _on_message(self, payload: bytes) -> None:
        self._handle(msgpack.unpackb(payload, use_list=True))

    def _handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        if kind in ("ready", "load_error"):
            starting = self._starting
            if starting is not None and not starting.done():
                if kind == "ready":
                    starting.set_result(None)
                else:
                    starting.set_exception(StepProcessError(msg[1]))
            return
        job, self._job = self._job, None
        if job is None:
            log.error("step process of '%s' answered with no step in flight", self.name)
            return
        seqs = job.new + job.running
        if kind == "step":
            outputs, job.infer_ns = msg[1], msg[2]
            job.outputs = [
                StepOutput(s.request_id, *out) for s, out in zip(seqs, outputs, strict=True)
            ]
            for s, out in zip(seqs, job.outputs, strict=True):
                if out.finished:  # the child freed its slot and forgot it
                    self._keys.pop(s, None)
        else:  # "error": the new sequences are gone in the child, the running ones stay
            job.error = StepProcessError(msg[1])
            for s in job.new:
                self._keys.pop(s, None)
        self._finish(job)

    def _finish(self, job: StepJob) -> None:
        assert self._loop is not None
        # Never re-enter the batcher from inside its own submit().
        self._loop.call_soon(job.on_done, job)

    def _on_exit(self) -> None:
        proc = self._proc
        self._drop_child()
        if self._stopping:
            return
        code = proc.exitcode if proc is not None else None
        error = StepProcessError(
            f"the step process of '{self.name}' exited"
            + (f" (exit code {code})" if code is not None else "")
        )
        if self._starting is not None:
            if not self._starting.done():
                self._starting.set_exception(error)  # died while loading: _spawn raises
            return
        log.error("%s; restarting it", error)
        job, self._job = self._job, None
        self._keys.clear()
        if job is not None:
            job.error = error
            self._finish(job)
        self._on_lost(error)
        self._restart = asyncio.ensure_future(self._restart_child())

    def _drop_child(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._up = False

    async def _restart_child(self) -> None:
        for attempt in range(10_000):
            if self._stopping:
                return
            old = self._proc
            if old is not None:
                await asyncio.to_thread(supervisor.reap, old, 5.0)
            try:
                await self._spawn()
            except Exception as exc:
                log.error("restarting the step process of '%s' failed: %s", self.name, exc)
                await asyncio.sleep(supervisor.restart_delay(attempt))
                continue
            self.restarts += 1
            log.warning("step process of '%s' is back (restart %d)", self.name, self.restarts)
            if self._on_back is not None:
                self._on_back()
            return


def _wire_spec(key: int, s: Sequence) -> tuple[Any, ...]:
    """A new sequence as the child rebuilds it (:meth:`DecoderEngine.build_sequence`)."""
    return (
        key,
        s.request_id,
        s.prompt_ids,
        dataclasses.astuple(s.params),
        s.max_tokens,
        sorted(s.stop_token_ids),
    )


# --- the child ---------------------------------------------------------------------------


def worker_main(conn: Connection, args: WorkerArgs) -> None:
    """The child's whole life: load, then run steps until told to stop or the pipe closes."""
    try:
        releaser = supervisor.settle_child(args.device, args.gpu)
        import torch

        torch.set_num_interop_threads(1)
        engine = DecoderEngine(
            args.model_path,
            GenerationConfig(**args.generation),
            args.device,
            args.dtype,
            args.cpu_threads,
        )
        engine.load()
        engine.create_instance(0)
    except Exception as exc:
        conn.send_bytes(msgpack.packb(("load_error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(msgpack.packb(("ready",)))
    try:
        _serve(conn, engine, releaser)
    except (EOFError, OSError):
        pass  # the server has gone


def _serve(conn: Connection, engine: DecoderEngine, releaser: CacheReleaser | None) -> None:
    seqs: dict[int, Sequence] = {}
    perf = time.perf_counter_ns
    while True:
        msg = msgpack.unpackb(conn.recv_bytes(), use_list=True)
        if msg[0] == "stop":
            return
        _, free, new_specs, running_keys = msg
        for key in free:
            seq = seqs.pop(key, None)
            if seq is not None:
                engine.free(seq)
        # A new sequence that cannot be built fails alone; the step runs for the rest.
        new: list[Sequence] = []
        built: dict[int, Sequence | str] = {}
        for key, request_id, prompt_ids, params, max_tokens, stop_ids in new_specs:
            try:
                seq = engine.build_sequence(
                    request_id, prompt_ids, _params(params), max_tokens, stop_ids
                )
            except Exception as exc:
                built[key] = f"{type(exc).__name__}: {exc}"
                continue
            built[key] = seqs[key] = seq
            new.append(seq)
        new_keys = [spec[0] for spec in new_specs]
        try:
            running = [_lookup(seqs, k) for k in running_keys]
            t0 = perf()
            outputs = iter(engine.step(new, running))
            infer_ns = perf() - t0
        except Exception as exc:
            for key in new_keys:  # the step gave their slots back; the parent forgets them too
                seq = seqs.pop(key, None)
                if seq is not None:
                    engine.free(seq)
            conn.send_bytes(msgpack.packb(("error", f"{type(exc).__name__}: {exc}")))
            continue
        answer = []
        for key in [*new_keys, *running_keys]:
            failed = built.get(key)
            if isinstance(failed, str):
                answer.append((-1, "", True, None, 0, 0, failed, "invalid_argument"))
                continue
            out = next(outputs)
            if out.finished:
                seqs.pop(key, None)
            answer.append(
                (
                    out.token_id,
                    out.text,
                    out.finished,
                    out.finish_reason,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.error,
                    out.error_code,
                )
            )
        conn.send_bytes(msgpack.packb(("step", answer, infer_ns)))
        if releaser is not None:
            releaser.maybe()  # after answering: the release is off the step's latency


def _params(fields: list[Any]) -> SamplingParams:
    """SamplingParams from the wire (msgpack brings the tuples back as lists)."""
    p = SamplingParams(*fields)
    return dataclasses.replace(p, stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids))


def _lookup(seqs: dict[int, Sequence], key: int) -> Sequence:
    seq = seqs.get(key)
    if seq is None:
        raise LookupError(f"sequence {key} is not in this step process (lost in a restart?)")
    return seq
