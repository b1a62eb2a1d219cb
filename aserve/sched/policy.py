"""When to cut a batch: the pure core of the batcher.

:func:`plan` takes the state of one model's queue, the clock and the
estimates, and says how many items to run now, or until when to wait. It has
no side effects, touches no asyncio object and reads no clock, so tests drive
it with plain numbers. Layer: ``sched`` (pure); called on the loop by
:mod:`aserve.loop.batcher`.

The rules, in order (``n`` = items waiting, ``L(k)`` = estimated run time of
a batch of ``k``):

1. Nothing runs while no instance is free: requests accumulate, and a batch
   is cut the moment an instance frees up.
   A batch is never larger than what finishes by the earliest deadline in
   the queue (``cap``: the largest ``k`` with ``now + L(k) <= deadline``,
   at least 1): under overload a full batch that runs past every deadline
   in it would serve nobody in time.
2. ``n >= cap``: run ``cap`` (the largest preferred size within it, if the
   cap is below ``max_batch_size``); with no deadline pressure ``cap`` is
   ``max_batch_size``.
3. ``n`` reaches a preferred size: run the largest preferred size that fits.
4. Wait for an echo if it pays (``echo``, measured by
   :class:`~aserve.sched.latency.Echoes`): when the clients a batch answered
   come back within a return time of its end (a closed loop), the end of a
   batch says that ``e`` more items are due at ``due`` and may come until
   ``by``. The mean rate cannot see them: it spreads them over the whole
   cycle, and with ``c`` such clients the queue splits into groups that take
   turns (at ``c`` = 16, batches of 8, or of 2 and 14). With
   ``m = min(n + e, next preferred size, max_batch_size)``, waiting serves
   the ``m`` items by ``due + L(m)``; running now serves them by
   ``max(now + L(n), due) + L(m - n)`` (the rest run as the next batch, as
   soon as both they and the instance are there; with another instance free,
   at ``due``). Wait when running now is the later: a return that is quick against the
   batch is worth a wait, one that takes as long as the small batch runs
   (say, a front that parses and tokenizes each returning request on the
   loop while the instance runs) is not. The wait ends by ``by``, cut to
   ``max_delay`` after the later of the oldest arrival and the moment the
   instance freed up (the batch end), and to ``deadline - L(m)``. So
   ``max_delay`` stays a hard bound on how long a request is held for
   company while an instance could run it; the time a request queued behind
   a busy instance is not held for company (rule 5's bound, from the oldest
   arrival, would forbid every echo wait: the requests queued behind a
   batch are always older than ``max_delay`` when it ends). An open loop has
   no echo (its arrivals are as many before an end as after), so nothing
   changes for it; nor for an idle server (an echo is only expected within twice
   ``max_delay`` of a batch end).
5. Otherwise run all ``n`` now if the oldest has waited ``max_delay``, or if
   waiting longer would make the earliest deadline miss
   (``deadline - L(n) <= now``).
6. Otherwise wait only if it pays: with arrivals at rate ``r`` the next
   target size ``m`` (next preferred size, else ``max_batch_size``) fills in
   ``w = (m - n) / r``; wait when that happens within both bounds of rule 5
   and the cost per item including the wait beats running now:
   ``(w + L(m)) / m < L(n) / n``. An idle server (``r`` ~ 0) or a model whose
   time grows in step with the batch never waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The batching settings the policy needs, in seconds."""

    max_batch_size: int
    max_delay: float
    preferred: tuple[int, ...] = ()  # ascending

    @classmethod
    def build(cls, max_batch_size: int, max_delay_ms: float, preferred: list[int]) -> BatchLimits:
        return cls(max_batch_size, max_delay_ms / 1000.0, tuple(sorted(set(preferred))))


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the policy sees of the queue."""

    items: int  # waiting items (sum of the requests' batch sizes)
    oldest_arrival: float
    earliest_deadline: float


@dataclass(frozen=True, slots=True)
class Plan:
    """Run ``take`` items now (0: nothing), else look again at ``wake_at`` (None: on an event)."""

    take: int
    wake_at: float | None = None


@dataclass(frozen=True, slots=True)
class Echo:
    """Items a batch end is expected to bring back (rule 4): ``items`` due at
    ``due``, still expected until ``by``; ``since``: when the instance freed up."""

    items: int
    due: float
    by: float
    since: float


_IDLE = Plan(0, None)


def plan(
    now: float,
    queue: QueueView,
    free_instances: int,
    limits: BatchLimits,
    latency: Callable[[int], float],
    arrival_rate: float,
    echo: Echo | None = None,
) -> Plan:
    """Decide what to run now; see the module docstring for the rules."""
    n = queue.items
    if free_instances <= 0 or n <= 0:
        return _IDLE
    cap = deadline_cap(now, queue.earliest_deadline, limits, latency)
    if n >= cap:
        if cap < limits.max_batch_size:
            within = [p for p in limits.preferred if p <= cap]
            return Plan(within[-1] if within else cap)
        return Plan(cap)
    fitting = [p for p in limits.preferred if p <= n]
    if fitting:
        return Plan(fitting[-1])

    run_now = latency(n)
    if echo is not None and run_now > 0.0:
        waiting = _wait_for_echo(now, n, queue, free_instances, limits, latency, echo, run_now)
        if waiting is not None:
            return waiting
    give_up_at = min(queue.oldest_arrival + limits.max_delay, queue.earliest_deadline - run_now)
    if now >= give_up_at:
        return Plan(n)

    target = next((p for p in limits.preferred if p > n), limits.max_batch_size)
    if arrival_rate <= 0.0 or run_now <= 0.0:
        return Plan(n)  # idle, or nothing measured yet: waiting cannot be shown to pay
    wait = (target - n) / arrival_rate
    if now + wait > give_up_at:
        return Plan(n)
    if (wait + latency(target)) / target >= run_now / n:
        return Plan(n)
    return Plan(0, min(now + wait, give_up_at))


def _wait_for_echo(
    now: float,
    n: int,
    queue: QueueView,
    free_instances: int,
    limits: BatchLimits,
    latency: Callable[[int], float],
    echo: Echo,
    run_now: float,
) -> Plan | None:
    """Rule 4: the plan that waits for ``echo``, or None where that does not pay."""
    target = min(n + echo.items, limits.max_batch_size)
    target = next((p for p in limits.preferred if n < p < target), target)
    if target <= n:
        return None
    run_then = latency(target)
    held_from = max(queue.oldest_arrival, echo.since)
    until = min(echo.by, held_from + limits.max_delay, queue.earliest_deadline - run_then)
    if now >= until or echo.due > until:
        return None
    due = max(echo.due, now)
    # The rest, behind a batch of n run now (or beside it, on another instance).
    rest_starts = due if free_instances > 1 else max(now + run_now, due)
    if due + run_then >= rest_starts + latency(target - n):
        return None
    return Plan(0, until)


def deadline_cap(
    now: float, deadline: float, limits: BatchLimits, latency: Callable[[int], float]
) -> int:
    """The largest batch (at least 1) whose estimated run ends by ``deadline``.

    A binary search over the estimates, which grow with the batch size; with
    nothing measured yet (estimates 0) it is ``max_batch_size``.
    """
    hi = limits.max_batch_size
    budget = deadline - now
    if latency(hi) <= budget:
        return hi
    if latency(1) > budget:
        return 1
    lo = 1  # latency(lo) <= budget < latency(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if latency(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def predicted_finish(
    now: float,
    items_ahead: int,
    items: int,
    instances: int,
    first_free_at: float,
    limits: BatchLimits,
    latency: Callable[[int], float],
    deadline: float = math.inf,
    ahead_deadline: float | None = None,
) -> float:
    """Earliest time a new request of ``items`` could finish, given the queue ahead.

    ``first_free_at`` is when the soonest instance is expected to be free
    (``now`` if one is). The queue ahead drains in batches spread over the
    instances, each as large as runs by ``ahead_deadline`` (see
    :func:`deadline_cap`): the earliest deadline of the queue and this
    request, which the batcher cuts the next batch by; when the caller does
    not know it, by half the time left to ``deadline``. Used by admission
    control to refuse at once what cannot make its deadline.
    """
    start = max(now, first_free_at)
    # The batches ahead run under their own, earlier deadlines: the batcher
    # sizes each by what its earliest request has left. Without that deadline,
    # assume half of this request's time, not all of it, or admission promises
    # batches of a size that the queue's older requests will not let run.
    cap_at = start + (deadline - start) / 2 if ahead_deadline is None else ahead_deadline
    size = deadline_cap(start, cap_at, limits, latency)
    total = items_ahead + items
    full_batches = (total - 1) // size
    last = total - full_batches * size
    rounds = math.ceil(full_batches / max(instances, 1))
    return start + rounds * latency(size) + latency(last)
