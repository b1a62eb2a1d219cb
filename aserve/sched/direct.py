"""Where ``direct`` sequence batching puts each sequence: its instance and batch row,
and the rows of one batch (pure; no clock, no asyncio, no torch).

Layer: ``sched``. Under ``direct`` (Triton's strategy) a sequence is bound for
its whole life to one instance and one row of that instance's batches, so a
model may keep per-sequence state inside itself, indexed by batch row. Slot
``s`` (the lowest free one, :class:`~aserve.sched.sequences.SequenceTable`)
is instance ``s // max_batch_size``, row ``s % max_batch_size``. A batch for
an instance puts each request at its sequence's row; the rows between them
are padding, and the batch is as large as its highest occupied row + 1.
The engine side (:mod:`aserve.engines.direct_rows`) builds that batch from
:func:`layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The key under which a request's inputs carry its sequence's slot to the engine
# side (a 0-d int64 array). A NUL can begin no tensor name a client sends.
SLOT_KEY = "\x00sequence_slot"


def place(slot: int, max_batch_size: int) -> tuple[int, int]:
    """The (instance, row) that sequence slot ``slot`` is bound to."""
    return divmod(slot, max_batch_size)


@dataclass(frozen=True)
class RowLayout:
    """One batch's rows: ``size`` rows in all; ``rows[i]`` is where request ``i`` (in the
    batch's order) sits; ``padding`` are the other rows below ``size``, ascending."""

    size: int
    rows: tuple[int, ...]
    padding: tuple[int, ...]


def layout(slots: Sequence[int], max_batch_size: int) -> RowLayout:
    """The rows of a batch of requests whose sequences hold ``slots`` (in batch order).

    Raises ValueError for slots of different instances, or two requests on one
    row: the dispatch in front never forms either (one batcher per instance,
    one request per sequence in a batch), so either is a bug, not a request's fault.
    """
    if not slots:
        raise ValueError("a batch of direct sequence requests needs at least one request")
    instance = slots[0] // max_batch_size
    rows = tuple(s - instance * max_batch_size for s in slots)
    if any(not 0 <= r < max_batch_size for r in rows):
        raise ValueError(f"slots {list(slots)} are not all of instance {instance}")
    if len(set(rows)) != len(rows):
        raise ValueError(f"two requests of one batch share a row: slots {list(slots)}")
    size = max(rows) + 1
    taken = set(rows)
    return RowLayout(size, rows, tuple(r for r in range(size) if r not in taken))
