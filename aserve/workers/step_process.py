"""A decoder model's steps in a child process: the engine gets its own GIL.

Why a process: a decode step is hundreds of small torch calls, and each one
gives the GIL up and takes it back. With the steps on a thread of the server
process, every stretch of Python the event loop runs (parsing requests,
encoding and writing a token chunk for each stream) makes the step wait for
the GIL; at 32 streams the steps ran ~20% slower than the same engine alone.
In a child process the steps and the loop run on two cores without meeting.

The parent keeps the engine's front (tokenizer and model shape, see
:meth:`DecoderEngine.load_front`) to validate and build sequences on the
loop. :class:`ProcessStepExecutor` is an :class:`~aserve.workers.job.Executor`,
as :class:`aserve.workers.step_executor.StepExecutor` is: the continuous batcher
submits one :class:`StepJob` at a time and gets it back through its
``on_done``, on the loop; between jobs the child runs ahead (see the class).
The job crosses a pipe as msgpack: new sequences
as their validated settings (the child rebuilds them with
:meth:`DecoderEngine.build_sequence`), the others by a key; outputs come back
as plain fields, each with its key. There is no thread on the parent side: the loop writes the
request and reads the answer through the pipe's transport
(:mod:`aserve.workers.pipe`). Layer: ``workers``; everything here runs on the
loop, the child's side is :func:`aserve.workers.child.step_main`.

The child owns the weights, the KV cache and every started sequence. It
ignores SIGINT/SIGTERM (the server drains first, then stops it) and exits
when the pipe closes, so it never outlives the server. Its life (spawn,
handshake, restart with backoff, stop) is its
:class:`~aserve.workers.supervisor.Supervisor`'s. If it dies, the step
in flight fails, every sequence it held is ended (``on_lost``), and a new
child is started; until it is up, :attr:`ProcessStepExecutor.live` is 0
(the model reports not ready), the batcher submits no step and its waiting
sequences stay queued, and ``on_live`` tells it when the new child is up.
A step submitted anyway fails with ``not_run`` set: it never reached a child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from aserve.config import GenerationConfig
from aserve.errors import InvalidArgument
from aserve.types.generation import StepOutput
from aserve.workers.child import WorkerArgs, step_main
from aserve.workers.job import StepJob
from aserve.workers.supervisor import Supervisor

if TYPE_CHECKING:
    from aserve.engines.decoder import Sequence

__all__ = ["ProcessStepExecutor", "StepProcessError", "WorkerArgs"]

log = logging.getLogger("aserve.executor")


class StepProcessError(RuntimeError):
    """The step process failed a step, died, or is being restarted."""


class ProcessStepExecutor:
    """Runs one decoder engine's steps in a child process, in submission order.

    An :class:`~aserve.workers.job.Executor` that also runs ahead
    (:class:`~aserve.workers.job.RunAhead`), checks each sequence before it is
    queued (:class:`~aserve.workers.job.SequenceCheck`: it must cross the
    pipe) and names its child (:class:`~aserve.workers.job.ChildProcesses`).

    Run-ahead (``generation.step_run_ahead`` steps, :attr:`run_ahead`): once a
    job is answered, the child goes on decoding that job's sequences (less
    those that finished) without a new one, and each such step comes back as
    a job of this executor's own (``running`` the sequences it stepped,
    ``stepped`` too), handed to the last submitted job's ``on_done``. A
    submitted job says what changes: its ``free`` are freed, its ``new``
    prefilled, and its ``running`` become the set the child decodes (it is
    applied between two steps; a member that finished meanwhile is skipped).
    Answers carry their sequences (``stepped``); those of a sequence freed
    since are dropped here: a cancelled sequence's late tokens never reach
    the batcher.
    """

    def __init__(self, args: WorkerArgs, on_lost: Callable[[BaseException], None]) -> None:
        self.args = args
        self.name = args.name
        self.run_ahead = GenerationConfig(**args.generation).step_run_ahead
        # Acknowledge every other answer: the child, run_ahead past the last
        # acknowledgement, is then never stopped by one on its way.
        self._ack_every = max(1, self.run_ahead // 2)
        self._on_lost = on_lost
        self.on_live: Callable[[], Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sup = Supervisor(
            step_main, (args,), f"step process of '{self.name}'", f"aserve-{self.name}-steps",
            StepProcessError, self._on_message, self._lost, self._live_changed,
        )  # fmt: skip
        self._job: StepJob | None = None
        self._on_done: Callable[[Any], Any] | None = None  # where steps run ahead are answered
        self._keys: dict[Sequence, int] = {}  # parent sequence -> the child's key
        self._seqs: dict[int, Sequence] = {}  # and back
        self._next_key = 0
        self._received = 0  # answers read from this child
        self._acked = 0  # the last count of them told to it
        self._stopping = False
        self._gone = False  # a send failed: no more steps until the supervisor has news

    @property
    def live(self) -> int:
        """1 while a child is up and answering, 0 while one is being restarted."""
        return 1 if self._sup.up and not self._gone else 0

    @property
    def restarts(self) -> int:
        return self._sup.restarts

    @property
    def pids(self) -> list[int]:
        """The child's process id while one is up (a :class:`ChildProcesses`)."""
        pid = self._sup.pid
        return [] if pid is None else [pid]

    async def start(self) -> None:
        """Start the child; returns once it has loaded the model (or raises why not)."""
        self._loop = asyncio.get_running_loop()
        await self._sup.start()

    def submit(self, job: StepJob) -> None:
        """Send a step to the child (loop side, never waits for it)."""
        self._on_done = job.on_done
        if not self.live:
            job.error = StepProcessError(f"the step process of '{self.name}' is restarting")
            job.not_run = True
            self._finish(job)
            return
        free = []
        for s in job.free:
            key = self._keys.pop(s, None)
            if key is not None:
                del self._seqs[key]
                free.append(key)
        new = []
        for s in job.new:
            key = self._next_key
            self._next_key += 1
            self._keys[s] = key
            self._seqs[key] = s
            new.append(_wire_spec(key, s))
        # One the child finished while this job was formed is no longer known here.
        running = [k for k in map(self._keys.get, job.running) if k is not None]
        try:
            payload = msgpack.packb(("step", self._received, free, new, running))
        except (TypeError, ValueError, OverflowError) as exc:
            # check() refuses such a sequence before it is queued; should one
            # still get here, its step fails (every member) instead of leaving
            # the batcher waiting for an answer that never comes.
            self._forget(job.new)
            job.error = StepProcessError(f"a step of '{self.name}' cannot be sent: {exc}")
            self._finish(job)
            return
        self._job = job
        self._acked = self._received
        channel = self._sup.channel
        assert channel is not None  # live
        try:
            channel.send(payload)
        except OSError as exc:  # the child is gone; on_lost follows once it is reaped
            self._job = None
            self._gone = True  # the batcher waits for on_live
            self._forget(job.new)
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
        """Let the child finish its current step and exit (that step is not answered)."""
        self._stopping = True
        await self._sup.stop(timeout)

    # --- answers, on the loop ------------------------------------------------------

    def _on_message(self, payload: bytes) -> None:
        if self._stopping:
            return
        msg = msgpack.unpackb(payload, use_list=True)
        if msg[0] == "ready":
            return
        self._received += 1
        if self.run_ahead and self._received - self._acked >= self._ack_every:
            self._ack()
        answered = msg[3] if msg[0] == "step" else msg[2]
        if answered:
            job, self._job = self._job, None
            if job is None:
                log.error("step process of '%s' answered with no step in flight", self.name)
                return
        elif self._on_done is None:
            log.error("step process of '%s' ran a step nobody asked for", self.name)
            return
        else:
            job = _Unasked(self._on_done)
        seqs = self._seqs
        if msg[0] == "step":
            rows, job.infer_ns = msg[1], msg[2]
            stepped, outputs = [], []
            for key, *out in rows:
                s = seqs.get(key)
                if s is None:
                    continue  # freed by the batcher since: nobody reads it
                stepped.append(s)
                outputs.append(StepOutput(s.request_id, *out))
                if out[2]:  # finished: the child freed its slot and forgot it
                    del seqs[key]
                    del self._keys[s]
            job.stepped, job.outputs = stepped, outputs
            if not answered:
                job.running = stepped
        else:  # "error": the new sequences are gone in the child, the running ones stay
            job.error = StepProcessError(msg[1])
            self._forget(job.new)
            if not answered:
                job.running = [s for s in map(seqs.get, msg[3]) if s is not None]
        self._finish(job)

    def _ack(self) -> None:
        """Tell the child how many answers have been read, so it may run on."""
        self._acked = self._received
        channel = self._sup.channel
        try:
            if channel is not None:
                channel.send(msgpack.packb(("ack", self._received)))
        except OSError:
            pass  # the child is gone: on_lost follows

    def _forget(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            key = self._keys.pop(s, None)
            if key is not None:
                del self._seqs[key]

    def _finish(self, job: StepJob) -> None:
        assert self._loop is not None
        # Never re-enter the batcher from inside its own submit().
        self._loop.call_soon(job.on_done, job)

    def _lost(self, reason: str) -> None:
        """The child died (and was reaped): the step in flight and every sequence it held
        are gone."""
        if self._stopping:
            return
        error = StepProcessError(reason)
        job, self._job = self._job, None
        self._keys.clear()
        self._seqs.clear()
        self._received = self._acked = 0  # the new child counts from 0
        if job is not None:
            job.error = error
            self._finish(job)
        self._on_lost(error)

    def _live_changed(self) -> None:
        self._gone = False
        if self.on_live is not None:
            self.on_live()


class _Unasked(StepJob):
    """A step the child ran ahead on its own, answered as a job of this executor's."""

    def __init__(self, on_done: Callable[[Any], Any]) -> None:
        # Set here, not through StepJob.__init__: one frame fewer per step.
        self.new, self.running, self.free, self.on_done = [], [], [], on_done


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
