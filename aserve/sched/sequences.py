"""Which sequences hold a model's slots, and when an idle one is freed (pure;
fake-clock tested).

Layer: ``sched``. :class:`SequenceTable` is the decision part of sequence
batching: a sequence opened by its start request, the slot it takes, the
check each later request passes (known, not ended, not started twice) and
the sequences idle past their limit. It touches no asyncio and reads no clock:
the loop's driver (:mod:`aserve.loop.sequences`) hands it ``now``, keeps the
waiters (a sequence's next request, a start waiting for a slot) and runs the
idle timer at :meth:`SequenceTable.next_expiry`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from aserve.errors import InvalidArgument
from aserve.types.sequence import SequenceId

# How many ended sequences are remembered, to tell "ended" from "never started".
REMEMBERED_ENDS = 4096

ENDED = "ended (its sequence_end request came)"
IDLE = "freed after being idle longer than max_sequence_idle_microseconds"
START_REFUSED = "ended: its start request was refused"


@dataclass(eq=False)
class Sequence:
    """One open sequence: its slot (None while its start waits for one), who
    uses it now, when it became idle, its state dict and the turn's waiters.

    ``users`` counts its requests between entering and their answer (the one
    whose turn it is and those waiting); only a sequence with none can be idle.
    ``waiters`` is the driver's: its requests waiting their turn, in order.
    """

    id: SequenceId
    slot: int | None = None
    users: int = 0
    idle_since: float = 0.0
    state: dict[str, Any] = field(default_factory=dict)
    # Its implicit states (input name -> the array fed back), kept by the loop's driver.
    implicit: dict[str, Any] = field(default_factory=dict)
    waiters: deque[Any] = field(default_factory=deque)
    busy: bool = False  # a request of it holds the turn now
    closed: str | None = None  # why it ended, once it has


def describe(seq_id: SequenceId) -> str:
    """A sequence's id as messages quote it."""
    return repr(seq_id) if isinstance(seq_id, str) else str(seq_id)


class SequenceTable:
    """A model's open sequences and its ``slots`` slots.

    A sequence is opened by a request with ``sequence_start`` and closed by
    the end of one with ``sequence_end``, or by :meth:`expire` once it has been
    idle (no request entered or running) for ``idle_s``.
    """

    def __init__(self, model: str, slots: int, idle_s: float) -> None:
        self.model = model
        self.slots = slots
        self.idle_s = idle_s
        self.open: dict[SequenceId, Sequence] = {}
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self.holders: dict[int, Sequence] = {}  # slot -> the open sequence holding it
        self._ended: OrderedDict[SequenceId, str] = OrderedDict()

    @property
    def active(self) -> int:
        """Sequences started and not yet ended (holding a slot or waiting for one)."""
        return len(self.open)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def start(self, seq_id: SequenceId) -> Sequence:
        """Open the sequence a start request names (without a slot yet: :meth:`take_slot`).

        Raises InvalidArgument if it is open already: a second start.
        """
        if seq_id in self.open:
            raise InvalidArgument(
                f"sequence {describe(seq_id)} of model '{self.model}' is already started "
                "and has not ended: a second sequence_start for it is refused (end it with "
                "sequence_end, or use a new sequence_id)"
            )
        self._ended.pop(seq_id, None)
        seq = Sequence(seq_id)
        self.open[seq_id] = seq
        return seq

    def find(self, seq_id: SequenceId) -> Sequence:
        """The open sequence a request that does not start one names.

        Raises InvalidArgument when it is not open: never started, or ended
        (saying how, for one ended lately).
        """
        seq = self.open.get(seq_id)
        if seq is not None:
            return seq
        why = self._ended.get(seq_id)
        if why is not None:
            raise InvalidArgument(
                f"sequence {describe(seq_id)} of model '{self.model}' has {why}; start a "
                "new one with sequence_start"
            )
        raise InvalidArgument(
            f"sequence {describe(seq_id)} of model '{self.model}' is unknown: its first "
            "request must have sequence_start true"
        )

    def take_slot(self, seq: Sequence) -> bool:
        """Give ``seq`` the lowest free slot; False when every slot is held."""
        if not self._free:
            return False
        seq.slot = heapq.heappop(self._free)
        self.holders[seq.slot] = seq
        return True

    def close(self, seq: Sequence, why: str) -> bool:
        """End ``seq`` (a no-op if it has ended already); True when it freed a slot."""
        if seq.closed is not None:
            return False
        seq.closed = why
        if self.open.get(seq.id) is seq:
            del self.open[seq.id]
        self._ended[seq.id] = why
        self._ended.move_to_end(seq.id)
        while len(self._ended) > REMEMBERED_ENDS:
            self._ended.popitem(last=False)
        seq.state.clear()  # freed with the sequence, whoever still holds the dict
        seq.implicit.clear()
        if seq.slot is None:
            return False
        del self.holders[seq.slot]
        heapq.heappush(self._free, seq.slot)
        return True

    def enter(self, seq: Sequence) -> None:
        """A request of ``seq`` entered: it is not idle until that one is answered."""
        seq.users += 1

    def leave(self, seq: Sequence, now: float) -> None:
        """A request of ``seq`` was answered (or failed, or gave up) at ``now``."""
        seq.users -= 1
        if seq.users == 0:
            seq.idle_since = now

    def expire(self, now: float) -> list[Sequence]:
        """Close every sequence idle for ``idle_s`` or longer at ``now``; the closed ones."""
        gone = [
            s for s in self.open.values()
            if s.users == 0 and now - s.idle_since >= self.idle_s
        ]  # fmt: skip
        for s in gone:
            self.close(s, IDLE)
        return gone

    def next_expiry(self) -> float | None:
        """When the next idle sequence will have been idle for ``idle_s`` (None: none is idle)."""
        idle = [s.idle_since for s in self.open.values() if s.users == 0]
        return min(idle) + self.idle_s if idle else None
