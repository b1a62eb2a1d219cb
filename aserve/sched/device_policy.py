"""Which model's batch a free slot of a shared device runs (pure; fake-clock tested).

Layer: ``sched``. The device scheduler (:mod:`aserve.loop.device_scheduler`)
collects one :class:`Claim` from each model's batcher that waits for a slot;
:func:`pick` chooses among them. The rule is earliest deadline first, made
safe for overload and for priorities:

1. A claim whose head request can still meet its deadline (on the model's
   measured time for a batch of it) ranks before every claim whose head
   cannot: a hopeless request never holds the slot from one that can be
   saved. (Its own batcher gives it up or times it out.)
2. Then the higher priority level (1 is the highest; 0, no levels, ranks as
   the default of a model without priorities, equal to every other 0).
3. Then the earlier deadline, then the request that came first.

Starvation: a claim is passed over only for another that is feasible and at
least as urgent, so a low priority waits only while higher ones have work
that fits; when the device has time left over, the low priority runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Claim:
    """What a waiting batcher would run next in a free slot."""

    feasible: bool  # its head request can still finish by its deadline
    level: int  # the head's priority level (lower is more urgent; 0: no levels)
    deadline: float  # the head's deadline, clock() seconds
    seq: int  # the head's arrival order, the last tie-break

    def rank(self) -> tuple[bool, int, float, int]:
        return (not self.feasible, self.level, self.deadline, self.seq)


def pick(claims: Sequence[Claim]) -> int:
    """The index of the claim the free slot goes to (``claims`` is not empty)."""
    best = 0
    best_rank = claims[0].rank()
    for i in range(1, len(claims)):
        rank = claims[i].rank()
        if rank < best_rank:
            best, best_rank = i, rank
    return best
