"""The one executor interface the batchers depend on, and the jobs it carries.

Layer: ``workers``. Plain data and protocols: nothing here runs anything.
A job is created and answered on the loop; in between an executor thread or
a child process (through its pipe) fills in its outcome. :class:`Staged` is
the one record both sides touch while a job waits: a lock decides whether
the loop may still change it or an instance thread has taken it.

Four executors satisfy :class:`Executor`: the instance threads of a batched
model (:class:`~aserve.workers.thread_pool.ExecutorPool`), its worker
processes (:class:`~aserve.workers.batch_process.ProcessPool`), and a decoder
model's step thread or step process
(:class:`~aserve.workers.step_executor.StepExecutor`,
:class:`~aserve.workers.step_process.ProcessStepExecutor`). What only some of
them can do is a capability of its own, declared here and tested once with
``isinstance`` by whoever relies on it: :class:`Staging`, :class:`Inline`
(the thread pool), :class:`RunAhead` and :class:`SequenceCheck` (the step
process), :class:`ChildProcesses` (the executors of child processes) and
:class:`EngineHandle` (those handed the engine they run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from aserve.engines.base import Engine
    from aserve.engines.decoder import Sequence as DecoderSequence
    from aserve.types.generation import StepOutput

J = TypeVar("J", contravariant=True)


@runtime_checkable
class Executor(Protocol[J]):
    """Runs jobs off the loop and answers each through its ``on_done``, on the loop.

    Health is one figure for every kind: ``live`` counts the instances (threads
    or child processes) that can take a job now; 0 means the model cannot
    serve until one is back. ``on_live`` (set by the owner, the batcher) is
    called on the loop each time ``live`` changes. ``restarts`` counts the
    instances replaced after dying.

    ``submit`` is called on the loop, never blocks and never calls
    ``on_done`` from inside itself (a batcher must not be re-entered). It
    usually hands the job off the loop; the thread pool alone may run a
    measured-tiny batch inline, on the loop, before answering it later
    (and, as :class:`Inline`, run one for the batcher to answer at once).
    """

    on_live: Callable[[], Any] | None

    @property
    def live(self) -> int: ...

    @property
    def restarts(self) -> int: ...

    async def start(self) -> None: ...

    def submit(self, job: J) -> None: ...

    async def stop(self, timeout: float = 10.0) -> None: ...


@runtime_checkable
class Staging(Protocol):
    """An executor that can hold the next batch ready while every instance is busy.

    The batcher stages a batch when no instance is free; the first instance
    that frees up takes it without waiting for the loop's turn (with many
    answers to write, the loop is late by milliseconds). Until then the loop
    may still grow it or take it back (:class:`Staged`), so it ends as the
    batch the loop would have cut at that moment. ``can_stage`` says whether
    a batch should wait there at all (not one the pool runs inline).
    """

    def can_stage(self) -> bool: ...

    def stage(self, job: BatchJob) -> Staged: ...


@runtime_checkable
class Inline(Protocol):
    """An executor that may run a tiny batch right here, on the loop, synchronously.

    For the idle server's fast path: a request that finds the model idle, of
    a batch size the executor has measured as tiny, runs while its handler
    waits, and the handler goes on without a turn of the loop in between (the
    plain handler's cost). ``run_inline`` fills in the job's outcome and
    timings and returns; it never calls ``on_done`` (the batcher answers).
    """

    def runs_inline(self, size: int) -> bool: ...

    def run_inline(self, job: BatchJob) -> None: ...


@runtime_checkable
class RunAhead(Protocol):
    """A step executor that goes on decoding its last step's sequences unasked.

    Once a step is answered it steps the same set again, up to ``run_ahead``
    steps past the last answer read, and answers each such step as a job of
    its own through the last submitted job's ``on_done`` (see
    :class:`StepJob`'s ``stepped``). The continuous batcher then submits a
    step only when the set changes. ``run_ahead`` 0 is an executor that waits
    for every step, as one that is not a :class:`RunAhead`.
    """

    run_ahead: int


@runtime_checkable
class SequenceCheck(Protocol):
    """A step executor that cannot take every sequence (one that must cross a pipe).

    ``check(seq)`` is called on the loop before the sequence is queued and
    raises :class:`~aserve.errors.InvalidArgument` for one it could not run:
    found at ``submit`` instead, it would fail the whole step.
    """

    def check(self, seq: DecoderSequence) -> None: ...


@runtime_checkable
class ChildProcesses(Protocol):
    """An executor whose instances are child processes; ``pids``: those up now."""

    @property
    def pids(self) -> list[int]: ...


@runtime_checkable
class EngineHandle(Protocol):
    """An executor handed the engine it runs (for worker processes, the server's
    front of it, loaded with ``load_front``, never run). It never unloads it:
    its owner does, after :meth:`Executor.stop`."""

    @property
    def engine(self) -> Engine: ...


class EnginePool(Executor["BatchJob"], EngineHandle, Protocol):
    """What a batched model's owner holds: an executor of batch jobs with its engine
    (the instance threads, the worker processes, or several pools of them)."""


class Staged:
    """A staged batch job, between the loop and the instance that takes it.

    Loop side: ``with staged.lock:`` and, while ``open`` is True, change the
    job or ``retract()`` it. Instance side: ``take()`` returns the job (and
    notes when) or None once retracted. ``lock`` is held for a few list
    operations at most.
    """

    __slots__ = ("job", "lock", "open", "staged_at", "taken_at")

    def __init__(self, job: BatchJob) -> None:
        self.job = job
        self.lock = threading.Lock()
        self.open = True  # neither taken nor retracted
        self.staged_at = time.perf_counter()
        self.taken_at = 0.0  # perf_counter() when an instance took it

    def retract(self) -> None:
        """Loop side, with ``lock`` held and ``open`` True: no instance will take it."""
        self.open = False

    def take(self) -> BatchJob | None:
        """Instance side: the job to run now, or None (the loop took it back)."""
        with self.lock:
            if not self.open:
                return None
            self.open = False
            self.taken_at = time.perf_counter()
        return self.job

    @property
    def held_s(self) -> float:
        """Seconds it waited staged before an instance took it (0 until then)."""
        return self.taken_at - self.staged_at if self.taken_at else 0.0


class BatchJob:
    """One batch on its way to an instance and back.

    ``on_done(job)`` is called on the loop after the instance filled in either
    ``outputs`` or ``error`` and the timings. ``tag`` is the submitter's own
    bookkeeping; the instance never reads it.

    The outcome fields start as class defaults, so that a submitter's own
    subclass (the batcher's record of a running batch *is* its job) sets only
    ``parts``, ``size`` and ``on_done``: one object and one ``__init__`` per
    batch, not two.
    """

    parts: Sequence[dict[str, np.ndarray]]
    size: int
    on_done: Callable[[Any], Any]
    tag: Any = None
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None
    input_ns = 0
    infer_ns = 0

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


class StepJob:
    """One engine step on its way to the step thread or process and back.

    ``free`` are sequences whose slots go back first (cancelled, expired, or
    left over from a failed step), so a step can reuse them at once. Then
    ``new`` are prefilled and ``running`` decoded; ``outputs`` has one entry
    per sequence of ``new + running``, in that order, unless ``error`` is set
    (``not_run`` too when the step never reached the engine).
    ``stepped``, when the executor sets it, are the sequences ``outputs`` are
    for instead (a step process that runs ahead answers with those it still
    decoded, and also makes jobs of its own for the steps it ran unasked:
    see :class:`~aserve.workers.step_process.ProcessStepExecutor`).
    ``tag`` is the submitter's own bookkeeping; the executor never reads it.
    The outcome fields start as class defaults, as :class:`BatchJob`'s do.
    """

    new: list[DecoderSequence]
    running: list[DecoderSequence]
    free: list[DecoderSequence]
    on_done: Callable[[Any], Any]
    tag: Any = None
    outputs: Sequence[StepOutput] = ()
    stepped: Sequence[DecoderSequence] | None = None
    error: BaseException | None = None
    not_run = False  # with error: the step never reached the engine
    infer_ns = 0

    def __init__(
        self,
        new: list[DecoderSequence],
        running: list[DecoderSequence],
        free: list[DecoderSequence],
        on_done: Callable[[StepJob], Any],
        tag: Any = None,
    ) -> None:
        self.new = new
        self.running = running
        self.free = free
        self.on_done = on_done
        self.tag = tag
