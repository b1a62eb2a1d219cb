"""One scheduler per shared device: which model's batch runs in the next free slot.

Layer: ``loop``; runs on the event loop only. A device whose ``devices``
entry says ``"scheduling": "shared"`` runs at most ``slots`` batches at once,
all its models together. Each model keeps its own batcher (queue, batching
policy, latency estimates, instances); the batcher asks the device for a slot
before it dispatches, and the device decides between the batchers that wait:

- While no batcher waits, a batcher that finds a slot free takes it at once
  (nothing is decided for it, and nothing costs more than a counter).
- When a slot frees up and batchers wait, each says what it would run next
  (:class:`~aserve.sched.device_policy.Claim`: its head request's priority
  level and deadline, and whether that request can still meet the deadline
  on the model's measured batch time); the slot goes to
  :func:`~aserve.sched.device_policy.pick`'s choice, whose batcher cuts its
  batch (never mixing models) as it would with an instance of its own free.
- A model whose head cannot finish in time never holds the slot from one that
  can: such a claim ranks below every one that can (its batcher gives that
  request up or times it out on its own).

The device also sums, for admission, the work its other models have queued
ahead of a request (:meth:`DeviceScheduler.ahead_s`): a model alone sees only
its own queue, and would promise deadlines that the device, busy with the
others, cannot keep.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from aserve.config import DeviceConfig
from aserve.sched.device_policy import Claim, pick

log = logging.getLogger("aserve.device")

# How many of the device's last batches the timeline keeps (the dashboard's strip).
TIMELINE_BATCHES = 512


class Member(Protocol):
    """What the device asks of a model's batcher."""

    label: str

    def claim(self, now: float) -> Claim | None:
        """What it would run next (None: nothing it can run)."""
        ...

    def granted(self) -> None:
        """A slot is its for one batch: cut and dispatch it now (or decline)."""
        ...

    def queued_work(self, now: float, level: int, deadline: float) -> float:
        """Seconds of its queued work that EDF at ``level`` and ``deadline`` runs first."""
        ...


@dataclass(slots=True)
class Ran:
    """One batch the device ran: which model, when (``clock()`` seconds), how large."""

    model: str
    started: float
    ended: float
    size: int


class DeviceScheduler:
    """The slots of one shared device and the batchers that wait for them."""

    def __init__(self, name: str, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.slots = slots
        self._clock = clock
        self.busy = 0  # batches running on the device
        self._ends: dict[int, tuple[float, str]] = {}  # a running batch's token -> (end, model)
        self._next_token = 0
        self._wanting: dict[Member, None] = {}  # batchers waiting for a slot (ordered set)
        self._granted: Member | None = None
        self._handing_out = False
        self.members: dict[Member, None] = {}
        self.timeline: deque[Ran] = deque(maxlen=TIMELINE_BATCHES)
        self.batches: dict[str, int] = {}  # batches run, by model

    # --- membership -------------------------------------------------------------

    def join(self, member: Member) -> None:
        self.members[member] = None

    def leave(self, member: Member) -> None:
        """``member`` no longer runs here (unloaded, or its device went independent);
        batches it has running still give their slots back when they end."""
        self.members.pop(member, None)
        self._wanting.pop(member, None)
        if self._granted is member:
            self._granted = None

    def resize(self, slots: int) -> None:
        """Take a new slot count in place (a reload): more slots run waiting batches
        at once; fewer let the batches running end before new ones start."""
        if slots == self.slots:
            return
        log.info("device %s: %d slot(s), was %d", self.name, slots, self.slots)
        self.slots = slots
        self.hand_out()

    # --- slots --------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Batchers waiting for a slot."""
        return len(self._wanting)

    def free_for(self, member: Member) -> int:
        """Slots ``member`` may take now: every free one while nobody waits, none while
        others wait (the next free slot is handed out by priority and deadline), one
        while a slot is being handed to it."""
        free = self.slots - self.busy
        if free <= 0:
            return 0
        if self._granted is not None:
            return 1 if self._granted is member else 0
        # Outside hand_out nobody waits while a slot is free (a release hands it
        # out), so this is every free slot; inside, the slot is someone's grant.
        return 0 if self._wanting else free

    def want(self, member: Member) -> None:
        """``member`` has a batch to run and no slot: it waits for the next one."""
        self._wanting[member] = None
        if not self._handing_out and self.busy < self.slots:
            self.hand_out()  # a slot is free (one was added): hand it out now

    def waits(self, member: Member) -> None:
        """``member`` will want the slot it is about to release (no handing out here:
        the release that follows does it)."""
        self._wanting[member] = None

    def acquire(self, model: str, expected_end: float) -> int:
        """A batch of ``model`` starts on a slot; returns its token for :meth:`release`."""
        self.busy += 1
        self._granted = None  # a grant is for one batch
        self._next_token += 1
        self._ends[self._next_token] = (expected_end, model)
        self.batches[model] = self.batches.get(model, 0) + 1
        return self._next_token

    def release(self, token: int, started: float, size: int) -> None:
        """The batch of ``token`` ended: its slot goes to the most urgent waiting batch."""
        end = self._ends.pop(token, None)
        if end is None:
            return
        self.busy -= 1
        self.timeline.append(Ran(end[1], started, self._clock(), size))
        if self._wanting:
            self.hand_out()

    def first_free_at(self, now: float) -> float:
        """When a slot is expected to be free (``now`` if one is)."""
        if self.busy < self.slots or not self._ends:
            return now
        return max(now, min(end for end, _ in self._ends.values()))

    def hand_out(self) -> None:
        """Give each free slot to the waiting batcher :func:`pick` chooses, until no
        slot is free or nobody waits. Reentrant calls (a batch that ran inline and
        ended within a grant) leave the work to the outer loop."""
        if self._handing_out:
            return
        self._handing_out = True
        try:
            while self.busy < self.slots and self._wanting:
                now = self._clock()
                claims: list[tuple[Claim, Member]] = []
                for member in list(self._wanting):
                    claim = member.claim(now)
                    if claim is None:
                        del self._wanting[member]  # nothing to run after all
                    else:
                        claims.append((claim, member))
                if not claims:
                    break
                chosen = claims[pick([c for c, _ in claims])][1]
                del self._wanting[chosen]
                self._granted = chosen
                chosen.granted()  # it dispatches (acquire) or declines
                self._granted = None
        finally:
            self._handing_out = False

    # --- admission --------------------------------------------------------------

    def ahead_s(self, member: Member, now: float, level: int, deadline: float) -> float:
        """Seconds the device is expected to spend before it can run ``member``'s
        request at ``level`` with ``deadline``: the other models' queued work that
        earliest deadline first (a higher level first) runs before it, spread over
        the slots, after the first slot frees up."""
        work = 0.0
        for other in self.members:
            if other is not member:
                work += other.queued_work(now, level, deadline)
        return self.first_free_at(now) - now + work / self.slots

    # --- what a user sees -----------------------------------------------------------

    def snapshot(self, timeline: bool = False) -> dict[str, object]:
        """The device now, for statistics and the dashboard (with ``timeline``: the
        last batches it ran, as [model, started, ended, size], ``clock()`` seconds)."""
        doc: dict[str, object] = {
            "name": self.name,
            "scheduling": "shared",
            "slots": self.slots,
            "busy": self.busy,
            "waiting": len(self._wanting),
            "running": sorted(model for _, model in self._ends.values()),
            "members": sorted(m.label for m in self.members),
            "batches": dict(self.batches),
        }
        if timeline:
            doc["timeline"] = [[r.model, r.started, r.ended, r.size] for r in self.timeline]
        return doc


class Devices:
    """The shared devices of one server, by name; a device not shared has none."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.shared: dict[str, DeviceScheduler] = {}
        self._wanted: set[str] = set()  # the devices the config in force shares

    def configure(self, devices: dict[str, DeviceConfig]) -> None:
        """Take a ``devices`` block: new shared devices get a scheduler, shared ones
        their new slot count in place; a device no longer shared keeps its scheduler
        until :meth:`assign` has moved every model off it."""
        for name, device in devices.items():
            if device.scheduling != "shared":
                continue
            current = self.shared.get(name)
            if current is None:
                self.shared[name] = DeviceScheduler(name, device.slots, self._clock)
            else:
                current.resize(device.slots)
        self._wanted = {n for n, d in devices.items() if d.scheduling == "shared"}

    def assign(self, placed: Iterable[tuple[str, Sharing]]) -> None:
        """Put each (device name, model) of ``placed`` on its device's scheduler, or
        on none where the device is not shared; then forget schedulers no one uses."""
        for name, model in placed:
            scheduler = self.shared.get(name) if name in self._wanted else None
            model.share(scheduler)
        for name in [n for n in self.shared if n not in self._wanted]:
            if not self.shared[name].members:
                del self.shared[name]

    def snapshot(self, timeline: bool = False) -> list[dict[str, object]]:
        return [s.snapshot(timeline) for s in self.shared.values()]


class Sharing(Protocol):
    """A runtime that can run on a shared device."""

    def share(self, device: DeviceScheduler | None) -> None: ...
