"""Which models leave a device to make room for a load, and what a first load costs.

Layer: ``sched`` (pure: no asyncio, no clock of its own; the caller passes
``now`` and each model's last use and request rate in its own time base).
Called on the loop by :mod:`aserve.loop.memory_budget`, which unloads what
this chooses.

Only the models that may leave are chosen: not resident (``"resident": true``,
or pinned by an explicit repository load), not busy (a request queued,
running, or waiting for it to load). Among them, by the device's
``eviction`` rule (:func:`make_room`):

- ``"cost"`` (the default): the model whose eviction costs least goes first.
  That cost is its recent request rate (:class:`RequestRate`, an
  exponentially decayed count of its requests, kept per model version by
  the caller) times its expected load time: the seconds of loading a second
  that evicting it is expected to bring back. Ties go least recently used
  first. A model loaded for a burst of one-off requests has a low rate and
  leaves before a hot one; a small fast-loading model before a large slow
  one of the same rate.
- ``"lru"``: least recently used first, whatever the rates.

With either rule no more leave than needed: a model chosen before a larger
one whose room alone would have been enough stays. Under ``"cost"``, when a
model that is busy only with requests in flight would be cheaper to evict
than what the idle ones offer, :func:`worth_waiting` names it: the caller
waits a little for it to go idle rather than evict a costlier one (a model
loaded for one request is still answering it when the next load comes).

Before a model has ever loaded, its footprint and load time are estimates
from its files' size (:func:`estimate_footprint_mib`, :func:`estimate_load_s`);
after, the measured ones are used. :func:`ready_at` says when a load waiting
behind others on a device that loads one at a time is expected to be over.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Literal

MIB = 1024 * 1024

Policy = Literal["cost", "lru"]
# How fast a model's request rate forgets: a request counts half after this
# long. Tens of seconds: long enough that a model's rate between two of its
# requests is still known at 0.2 requests a second (the tail of
# bench/memory_budget.py's Zipf traffic), short enough that a model that
# goes cold leaves within a minute or two.
HALF_LIFE_S = 30.0

# A first load's footprint, before it was ever measured: the files' size times
# FOOTPRINT_RATIO plus FOOTPRINT_OVERHEAD_MIB. Measured on CPU (the 24
# TorchScript MLPs of bench/memory_budget.py, 2 to 33 MiB), a load's RSS grows
# by its file's size times 1.1 and about 1 MiB (the engine, its instance
# thread, the warm-up's buffers), within 1 MiB from one load to the next; the
# first load of a process also pays torch's own one-time setup (about 12 MiB),
# which is made room for after that load. Above what is measured, so that the
# budget holds while a load runs; a load whose estimate cannot fit is still
# tried on its files' size (aserve.loop.memory_budget), the measure deciding.
FOOTPRINT_RATIO = 1.15
FOOTPRINT_OVERHEAD_MIB = 4.0
# A first load's time, before it was ever measured: a fixed cost (building the
# engine, starting instances, the warm-up batches) plus reading the files at a
# disk's sequential rate. Deliberately not pessimistic: a request refused on an
# estimate that is too long is a request the model could have served.
LOAD_FIXED_S = 0.5
LOAD_READ_MIB_PER_S = 200.0


def estimate_footprint_mib(file_bytes: int) -> float:
    """What a model whose files hold ``file_bytes`` is assumed to hold once loaded."""
    return file_bytes / MIB * FOOTPRINT_RATIO + FOOTPRINT_OVERHEAD_MIB


def estimate_load_s(file_bytes: int) -> float:
    """How long a first load of ``file_bytes`` of files is assumed to take."""
    return LOAD_FIXED_S + file_bytes / MIB / LOAD_READ_MIB_PER_S


class RequestRate:
    """A model's recent request rate: an exponentially decayed count of its
    requests, each counting half after ``half_life_s`` (the caller's clock).

    Decay multiplies every model's count by the same factor, so the order of
    two models' rates changes only at a request, never with time alone.
    """

    __slots__ = ("_at", "_count", "half_life_s")

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._count = 0.0
        self._at = 0.0

    def count(self, now: float) -> float:
        """The decayed count of the requests noted, at ``now``."""
        if self._count == 0.0:
            return 0.0
        return self._count * 0.5 ** (max(0.0, now - self._at) / self.half_life_s)

    def note(self, now: float) -> None:
        """One request at ``now``."""
        self._count = self.count(now) + 1.0
        self._at = max(self._at, now)

    def per_s(self, now: float) -> float:
        """Requests a second: a steady rate ``r`` holds a count of ``r`` times
        the mean life of a count (``half_life_s / ln 2``)."""
        return self.count(now) * math.log(2) / self.half_life_s


@dataclass(frozen=True)
class Held:
    """A model loaded on the device, as the eviction choice sees it."""

    label: str
    footprint_mib: float
    last_used: float  # when a request last entered or left it (the caller's clock)
    resident: bool  # never unloaded to make room
    busy: bool  # a request queued, running or waiting for it
    rate_per_s: float = 0.0  # its recent request rate (RequestRate.per_s)
    load_s: float = 0.0  # how long a load of it is expected to take

    @property
    def cost(self) -> float:
        """What evicting it is expected to cost: seconds of reloading it a second."""
        return self.rate_per_s * self.load_s


@dataclass(frozen=True)
class Room:
    """The answer of :func:`make_room`: unload ``evict`` (in this order) and the
    load fits; or, when ``fits`` is False, even that would not make it fit."""

    evict: tuple[str, ...]
    fits: bool
    free_mib: float  # the budget left once ``evict`` are unloaded


def make_room(
    held: Sequence[Held], need_mib: float, budget_mib: float, policy: Policy = "cost"
) -> Room:
    """The models to unload so that ``need_mib`` more fits within ``budget_mib``
    beside what ``held`` holds, in the order ``policy`` gives (see the module's
    docstring); no more than needed."""
    free = budget_mib - sum(h.footprint_mib for h in held)
    if need_mib <= free:
        return Room((), True, free)
    order = sorted(
        (h for h in held if not (h.resident or h.busy)),
        key=(lambda h: (h.cost, h.last_used)) if policy == "cost" else (lambda h: h.last_used),
    )
    evict: list[Held] = []
    for h in order:
        evict.append(h)
        free += h.footprint_mib
        if need_mib <= free:
            break
    else:
        return Room(tuple(h.label for h in evict), False, free)
    # The last one chosen may have freed enough alone: those before it whose
    # room is not needed stay, the costliest to evict looked at first.
    kept = []
    for i in range(len(evict) - 2, -1, -1):
        if need_mib <= free - evict[i].footprint_mib:
            free -= evict[i].footprint_mib
            kept.append(i)
    chosen = [h for i, h in enumerate(evict) if i not in kept]
    return Room(tuple(h.label for h in chosen), True, free)


def _cost_of(room: Room, held: Sequence[Held]) -> float:
    by_label = {h.label: h for h in held}
    return sum(by_label[label].cost for label in room.evict)


def worth_waiting(
    held: Sequence[Held], need_mib: float, budget_mib: float, waitable: Collection[str]
) -> tuple[str, ...]:
    """Under the cost rule: the busy models of ``waitable`` (labels; busy with
    requests in flight, so idle soon) to wait for before making room, because
    with them idle the choice would cost less than the one among the idle
    models now (or would fit where that does not). Empty when waiting would not
    help. Resident ones never count."""
    now_room = make_room(held, need_mib, budget_mib, "cost")
    if now_room.fits and not now_room.evict:
        return ()
    idle_soon = [
        replace(h, busy=False) if h.busy and h.label in waitable and not h.resident else h
        for h in held
    ]
    then = make_room(idle_soon, need_mib, budget_mib, "cost")
    busy = {h.label for h in held if h.busy}
    wait = tuple(label for label in then.evict if label in busy)
    if not wait or not then.fits:
        return ()
    if now_room.fits and _cost_of(then, idle_soon) >= _cost_of(now_room, held):
        return ()
    return wait


@dataclass(frozen=True)
class Queued:
    """A load on a device, as :func:`ready_at` sees it: begun (``started_at``, the
    caller's clock) or waiting for the loads ahead of it."""

    expected_s: float
    started_at: float | None = None


def ready_at(queue: Sequence[Queued], index: int, now: float, one_at_a_time: bool) -> float:
    """When ``queue[index]`` is expected to be loaded. With ``one_at_a_time`` (a
    device with a memory budget) each load waits for those before it in
    ``queue`` (a begun one ends at its start plus its expected time, never
    before ``now``); otherwise each load runs at once, on its own."""
    if not one_at_a_time:
        q = queue[index]
        return (q.started_at if q.started_at is not None else now) + q.expected_s
    t = now
    for q in queue[: index + 1]:
        if q.started_at is not None:
            t = max(t, q.started_at + q.expected_s)
        else:
            t += q.expected_s
    return t
