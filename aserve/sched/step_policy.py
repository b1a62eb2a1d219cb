"""What the next decode step runs: the pure core of the continuous batcher.

:func:`plan_step` takes the running sequences and the waiting queues (one per
priority, lower values first; each earliest deadline first) as plain numbers,
and the clock, and says what one engine step does. It has no side effects and
reads no clock, so tests drive it with numbers (layer: ``sched``, pure; called
on the loop by :mod:`aserve.loop.continuous`). The rules:

1. Expired sequences leave: a waiting one whose deadline has passed is
   answered with a timeout and never starts, whatever its priority; a
   running one is ended and its slot freed before the step.
2. Every running sequence whose reader keeps up is decoded. One whose reader
   is ``stream_buffer_chunks`` steps behind is paused: it keeps its slot but
   is left out until the reader catches up.
3. Waiting sequences are admitted (prefilled in this step) in priority order
   (vLLM's ``priority``: lower first), and within a priority in deadline
   order, while a slot is free and the prompt tokens admitted in this step
   stay within ``max_prefill_tokens``. The first one is admitted whatever its
   length, so a long prompt is never starved; admission stops at the first
   that does not fit, so no later deadline overtakes an earlier one and no
   lower priority a higher one. A running sequence is never preempted: a
   higher priority waits for a slot to free. So a low priority waits only
   while a higher one waits for a slot (or for this step's prefill budget).
   With ``max_num_batched_tokens`` (chunked prefill) an admitted prompt may
   be prefilled over several steps: the engine spends each step's token
   budget (what the decodes leave of it) on admitted prompts in admission
   order. The engine, not the plan, cuts the chunks: only it knows how much
   of each prompt the prefix cache already holds.
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
    """Indices into the running list, and (queue, index) pairs into the waiting
    queues, that the plan was given."""

    expire_running: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    expire_waiting: list[tuple[int, int]] = field(default_factory=list)  # (queue, index)
    admit: list[tuple[int, int]] = field(default_factory=list)  # in the order admitted
    wake_at: float | None = None  # with nothing to run: when to look again (None: on an event)

    @property
    def runs(self) -> bool:
        return bool(self.decode or self.admit)


def plan_step(
    now: float,
    running: Sequence[RunningView],
    waiting: Iterable[Iterable[WaitingView]],
    slots_held: int,
    limits: StepLimits,
) -> StepPlan:
    """Decide one step.

    ``waiting`` holds one queue per priority, the most urgent (lowest value)
    first, each in deadline order and iterated lazily: past the point where
    admission stops, only each queue's expired head and its first live
    deadline are read. A waiting sequence is named ``(queue, index)``; what a
    plan expires and admits of one queue is a prefix of it.

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
    admitting = True  # until one does not fit: no later one overtakes it
    for q, queue in enumerate(waiting):
        for i, w in enumerate(queue):
            if w.deadline <= now:
                plan.expire_waiting.append((q, i))
                continue
            if (
                not admitting
                or free <= 0
                or (plan.admit and tokens + w.prompt_tokens > limits.max_prefill_tokens)
            ):
                admitting = False
                # The rest of this queue has later deadlines: none has expired.
                earliest = w.deadline if earliest is None else min(earliest, w.deadline)
                break
            plan.admit.append((q, i))
            tokens += w.prompt_tokens
            free -= 1
    if not plan.runs:
        plan.wake_at = earliest
    return plan
