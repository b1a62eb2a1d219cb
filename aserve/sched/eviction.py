"""Which models leave a device to make room for a load, and what a first load costs.

Layer: ``sched`` (pure: no asyncio, no clock of its own; the caller passes
each model's last use in its own time base). Called on the loop by
:mod:`aserve.loop.memory_budget`, which unloads what this chooses.

The rule is least recently used first, among the models that may leave: not
resident (``"resident": true``, or pinned by an explicit repository load), not
busy (a request queued, running, or waiting for it to load). Before a model
has ever loaded, its footprint and load time are estimates from its files'
size (:func:`estimate_footprint_mib`, :func:`estimate_load_s`); after, the
measured ones are used. :func:`ready_at` says when a load waiting behind
others on a device that loads one at a time is expected to be over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1024 * 1024

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


@dataclass(frozen=True)
class Held:
    """A model loaded on the device, as the eviction choice sees it."""

    label: str
    footprint_mib: float
    last_used: float  # when a request last entered or left it (the caller's clock)
    resident: bool  # never unloaded to make room
    busy: bool  # a request queued, running or waiting for it


@dataclass(frozen=True)
class Room:
    """The answer of :func:`make_room`: unload ``evict`` (in this order) and the
    load fits; or, when ``fits`` is False, even that would not make it fit."""

    evict: tuple[str, ...]
    fits: bool
    free_mib: float  # the budget left once ``evict`` are unloaded


def make_room(held: Sequence[Held], need_mib: float, budget_mib: float) -> Room:
    """The models to unload, least recently used first, so that ``need_mib`` more
    fits within ``budget_mib`` beside what ``held`` holds; no more than needed."""
    free = budget_mib - sum(h.footprint_mib for h in held)
    if need_mib <= free:
        return Room((), True, free)
    evict: list[str] = []
    for h in sorted(held, key=lambda h: h.last_used):
        if h.resident or h.busy:
            continue
        evict.append(h.label)
        free += h.footprint_mib
        if need_mib <= free:
            return Room(tuple(evict), True, free)
    return Room(tuple(evict), False, free)


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
