"""What the next decode step runs: the pure core of the continuous batcher.

:func:`plan_step` takes the running sequences and the head of the waiting
queue (earliest deadline first) as plain numbers, and the clock, and says
what one engine step does. It has no side effects and reads no clock, so
tests drive it with numbers (layer: ``sched``, pure; called on the loop by
:mod:`aserve.loop.continuous`). The rules:

1. Expired sequences leave: a waiting one whose deadline has passed is
   answered with a timeout and never starts; a running one is ended and its
   slot freed before the step.
2. Every running sequence whose reader keeps up is decoded. One whose reader
   is ``stream_buffer_chunks`` steps behind is paused: it keeps its slot but
   is left out until the reader catches up.
3. Waiting sequences are admitted (prefilled in this step) in deadline order
   while a slot is free and the prompt tokens admitted in this step stay
   within ``max_prefill_tokens``. The first one is admitted whatever its
   length, so a long prompt is never starved; admission stops at the first
   that does not fit, so no later deadline overtakes an earlier one.
4. With nothing to run, the batcher sleeps until the earliest deadline (or
   until an arrival, a cancellation or a reader that catches up wakes it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_seqs: int
    max_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class RunningView:
    deadline: float
    paused: bool  # its reader is too far behind


@dataclass(frozen=True, slots=True)
class WaitingView:
    deadline: float
    prompt_tokens: int


@dataclass(slots=True)
class StepPlan:
    """Indices into the running list and the waiting head the plan was given."""

    expire_running: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    expire_waiting: list[int] = field(default_factory=list)
    admit: list[int] = field(default_factory=list)
    wake_at: float | None = None  # with nothing to run: when to look again (None: on an event)

    @property
    def runs(self) -> bool:
        return bool(self.decode or self.admit)


def plan_step(
    now: float,
    running: Sequence[RunningView],
    waiting: Iterable[WaitingView],
    slots_held: int,
    limits: StepLimits,
) -> StepPlan:
    """Decide one step; ``waiting`` is iterated lazily, in deadline order.

    ``slots_held`` counts every slot still taken, the running sequences'
    included; the slots of expiring sequences are free for this step's
    admissions (they are freed first).
    """
    plan = StepPlan()
    earliest: float | None = None
    for i, r in enumerate(running):
        if r.deadline <= now:
            plan.expire_running.append(i)
            continue
        if not r.paused:
            plan.decode.append(i)
        earliest = r.deadline if earliest is None else min(earliest, r.deadline)
    free = limits.max_num_seqs - slots_held + len(plan.expire_running)
    tokens = 0
    for i, w in enumerate(waiting):
        if w.deadline <= now:
            plan.expire_waiting.append(i)
            continue
        if free <= 0 or (plan.admit and tokens + w.prompt_tokens > limits.max_prefill_tokens):
            earliest = w.deadline if earliest is None else min(earliest, w.deadline)
            break
        plan.admit.append(i)
        tokens += w.prompt_tokens
        free -= 1
    if not plan.runs:
        plan.wake_at = earliest
    return plan
