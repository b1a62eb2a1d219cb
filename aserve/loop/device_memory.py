"""One device's memory: its budget, its loads' lock and queue, what its loaded models hold.

Layer: loop; runs on the event loop. :class:`aserve.loop.memory_budget.MemoryBudget`
keeps one :class:`DeviceMemory` per device and decides with it; this module
only keeps the books: which runtimes are loaded and what each was measured
to hold (:class:`Held`), and which loads are waiting or running, for when a
load that waits behind others is expected to be over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from aserve.loop.runtimes.base import ModelState, Runtime
from aserve.obs.stats import Histogram
from aserve.sched.eviction import (
    MIB,
    Policy,
    Queued,
    RequestRate,
    estimate_footprint_mib,
    estimate_load_s,
    ready_at,
)

LOAD_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class OnDemand(Protocol):
    """What the budget needs of an on-demand model's runtime
    (:class:`aserve.loop.runtimes.on_demand.OnDemandRuntime`) to evict it."""

    label: str
    last_used: float  # time.monotonic() when a request last entered or left it

    @property
    def resident(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    async def until_idle(self, timeout_s: float) -> bool: ...
    async def evict(self, reason: str, park: bool) -> int | None: ...


@dataclass
class ModelMemory:
    """One model version's loads and memory, kept across its runtimes."""

    label: str
    device: str
    file_bytes: int | None = None  # its files' size, once sized
    footprint_mib: float | None = None  # measured at its last load
    method: str = ""  # how: cuda_allocator, rss, children_rss, file_size
    overlapped: bool = False  # another load on the device ran meanwhile
    load_s: float | None = None  # its last load's time, measured
    full_s: float | None = None  # its last load's that was not a restore
    loads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0, "cancelled": 0})
    evictions: int = 0
    restores: int = 0  # of the ok loads, those that read a parked runtime's weights back
    last_error: str | None = None
    load_seconds: Histogram = field(default_factory=lambda: Histogram(LOAD_BUCKETS_S))
    # Its requests' recent rate (time.monotonic()), noted by its on-demand runtime
    # at each request, loaded or not: what evicting it would cost.
    requests: RequestRate = field(default_factory=RequestRate)

    def need_mib(self) -> float:
        """What a load of it needs: measured, else estimated from its files."""
        if self.footprint_mib is not None:
            return self.footprint_mib
        return estimate_footprint_mib(self.file_bytes or 0)

    def floor_mib(self) -> float:
        """What a load of it needs at least: measured, else its files' size."""
        if self.footprint_mib is not None:
            return self.footprint_mib
        return (self.file_bytes or 0) / MIB

    def expected_load_s(self) -> float:
        """How long a load of it takes: its last, else estimated from its files."""
        if self.load_s is not None:
            return self.load_s
        return estimate_load_s(self.file_bytes or 0)

    def full_load_s(self) -> float:
        """How long a load of it that is not a restore takes, for what evicting it
        costs: the mean of its measured loads, or its last full one where some
        were restores; else estimated from its files."""
        if self.full_s is not None and self.restores:
            return self.full_s
        return self.mean_load_s()

    def mean_load_s(self) -> float:
        """How long a load of it takes, for what evicting it costs: the mean of its
        measured loads (one slow load under contention weighs less than as the
        last), else estimated from its files."""
        n = sum(self.load_seconds.counts)
        return self.load_seconds.sum / n if n else self.expected_load_s()

    def doc(self) -> dict[str, Any]:
        """Its entry in the model's statistics and the repository index."""
        return {
            "device": self.device,
            "footprint_mib": _round(self.footprint_mib),
            "footprint_method": self.method or None,
            "footprint_overlapped": self.overlapped,
            "load_s": _round(self.load_s),
            "expected_load_s": round(self.expected_load_s(), 3),
            "loads": dict(self.loads),
            "evictions": self.evictions,
            "restores": self.restores,
            "last_error": self.last_error,
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


@dataclass
class Held:
    """A loaded runtime and what it was measured to hold."""

    runtime: Runtime
    footprint_mib: float
    owner: OnDemand | None  # None: loaded at startup or by a reload, never evicted
    record: ModelMemory
    parked: bool = False  # evicted with its weights released: what it still holds


class LoadCount:
    """Loads being measured (on one device, or in the whole process): whether
    another ran while one was measured."""

    def __init__(self) -> None:
        self.loading = 0  # measures running now
        self.started = 0  # measures begun, ever: a changed count means one overlapped

    @contextlib.contextmanager
    def measuring(self) -> Iterator[Callable[[], bool]]:
        """Count a measure while the block runs; yields whether another overlapped it
        (read it after the block)."""
        self.loading += 1
        self.started += 1
        started = self.started
        alone = self.loading == 1
        try:
            yield lambda: not alone or self.started != started
        finally:
            self.loading -= 1


class DeviceMemory:
    """One device: its budget, the loads' lock and queue, and what its loaded models hold."""

    def __init__(self, name: str, budget_mib: int | None, eviction: Policy = "cost") -> None:
        self.name = name
        self.budget_mib = budget_mib
        self.eviction: Policy = eviction  # which idle model leaves first (sched.eviction)
        self.park = False  # evicted models parked (park_evicted), not unloaded
        # Held for a whole load on a budgeted device (one load at a time, so that
        # each measure is the model's own); each device has its own.
        self.lock = asyncio.Lock()
        self._held: dict[int, Held] = {}  # by id() of the loaded runtime
        self._queue: dict[int, Queued] = {}  # loads waiting or running, in arrival order
        self.count = LoadCount()  # its loads' measures

    # --- what is held ------------------------------------------------------------

    def entries(self) -> list[Held]:
        """The models loaded now. A runtime unloaded by whoever owned it (a reload's
        retired one, the stop) holds nothing and leaves here at the next look."""
        for key in [
            k for k, e in self._held.items()
            if e.runtime.state is ModelState.UNAVAILABLE and not (e.parked and e.runtime.parked)
        ]:  # fmt: skip
            del self._held[key]
        return list(self._held.values())

    def used_mib(self) -> float:
        return sum(e.footprint_mib for e in self.entries())

    def hold(self, entry: Held) -> None:
        self._held[id(entry.runtime)] = entry

    def held_mib(self, runtime: Runtime) -> float:
        """What ``runtime`` is held to hold now (a parked one's rest; 0: none)."""
        entry = self._held.get(id(runtime))
        return entry.footprint_mib if entry is not None else 0.0

    def forget(self, runtime: Runtime) -> None:
        self._held.pop(id(runtime), None)

    # --- the loads' queue ----------------------------------------------------------

    def enqueue(self, runtime: Runtime, expected_s: float) -> None:
        self._queue[id(runtime)] = Queued(expected_s)

    def expect(self, runtime: Runtime, expected_s: float) -> None:
        """A better estimate of a queued load (its files sized meanwhile)."""
        q = self._queue.get(id(runtime))
        if q is not None:
            self._queue[id(runtime)] = Queued(expected_s, q.started_at)

    def begin(self, runtime: Runtime, now: float) -> None:
        q = self._queue.get(id(runtime))
        if q is not None:
            self._queue[id(runtime)] = Queued(q.expected_s, now)

    def dequeue(self, runtime: Runtime) -> None:
        self._queue.pop(id(runtime), None)

    def ready_at(self, runtime: Runtime | None, expected_s: float, now: float) -> float:
        """When the load of ``runtime`` is expected to be over; a runtime not queued
        (None: not made yet) as if it joined the queue now, expected ``expected_s``."""
        queue = list(self._queue.values())
        keys = list(self._queue)
        key = id(runtime) if runtime is not None else None
        if key in self._queue:
            index = keys.index(key)
        else:
            queue.append(Queued(expected_s))
            index = len(queue) - 1
        return ready_at(queue, index, now, one_at_a_time=self.budget_mib is not None)
