"""The one executor interface the batchers depend on, and the jobs it carries.

Layer: ``workers``. Plain data and a protocol: nothing here runs anything.
A job is created and answered on the loop; in between an executor thread or
a child process (through its pipe) fills in its outcome.

Four executors satisfy :class:`Executor`: the instance threads of a batched
model (:class:`~aserve.workers.thread_pool.ExecutorPool`), its worker
processes (:class:`~aserve.workers.batch_process.ProcessPool`), and a decoder
model's step thread or step process
(:class:`~aserve.workers.step_executor.StepExecutor`,
:class:`~aserve.workers.step_process.ProcessStepExecutor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

if TYPE_CHECKING:
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
    measured-tiny batch inline, on the loop, before answering it later.
    """

    on_live: Callable[[], Any] | None

    @property
    def live(self) -> int: ...

    @property
    def restarts(self) -> int: ...

    async def start(self) -> None: ...

    def submit(self, job: J) -> None: ...

    async def stop(self, timeout: float = 10.0) -> None: ...


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
