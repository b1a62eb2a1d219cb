"""The next batch, staged: the loop's side of a batch waiting behind busy instances.

Layer: ``loop``; runs on the event loop. While every instance is busy, the
batcher hands an executor that can (:class:`~aserve.workers.job.Staging`, the
thread pool) the batch it would cut the moment the first instance frees up,
and that instance takes it at once, without waiting for the loop's turn (with
many answers to write, the loop is late by milliseconds). Until then the loop
keeps it the batch it would cut now.

One object is shared with the instance threads while both sides run, the
:class:`~aserve.workers.job.Staged` record; its lock decides who has the
batch, and this module is the only loop code that takes it. The batch is in
one of three states:

- **staged**: no instance has taken it. Under the lock the loop may add
  requests to it, take out one whose client went away, or take it back; an
  instance that frees up meanwhile waits for the lock and finds the batch as
  the loop left it, never half changed.
- **taken**: an instance runs it, and nothing in it changes any more. The
  loop learns so at its next look (:meth:`StagedBatch.refresh`), or when the
  batch's answer comes first, and from then on keeps it as a running batch.
- **taken back**: the loop retracted it; no instance will run it, and its
  requests go back to the queue (or are answered, on close).

The batcher decides what the batch should be (its queue, the policy) and
keeps the deadline timers and the running batches; this module holds the
transitions and the rules of what a staged batch takes in and gives up.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

from aserve.loop.request import InferenceRequest
from aserve.workers.job import Staged


class Batch(Protocol):
    """A batch job as staging changes it (the batcher's record of its batches)."""

    requests: list[InferenceRequest]
    parts: list[dict[str, np.ndarray]]  # the requests' inputs, in the same order
    size: int  # items: the requests' batch sizes, summed
    earliest: float  # the earliest deadline among the requests


B = TypeVar("B", bound=Batch)


class Seen(enum.Enum):
    """What the loop found when it looked at the staged batch, or changed it."""

    STAGED = "staged"  # no instance has taken it
    TAKEN = "taken"  # an instance runs it: a running batch from now on
    TAKEN_BACK = "taken back"  # the loop retracted it: no instance will run it


class StagedBatch(Generic[B]):
    """A batch staged behind busy instances, as the loop holds it: the batch and
    its record with the executor (``record``, from :meth:`Staging.stage`)."""

    __slots__ = ("_record", "batch")

    def __init__(self, batch: B, record: Staged) -> None:
        self.batch = batch
        self._record = record

    @property
    def held_s(self) -> float:
        """Seconds it waited staged before an instance took it (0 until one did)."""
        return self._record.held_s

    def refresh(
        self,
        top: Callable[[], InferenceRequest | None],
        pop_top: Callable[[], InferenceRequest],
        cut: Callable[[InferenceRequest], int],
    ) -> Seen:
        """Make it the batch the loop would cut now, unless an instance took it.

        ``top()`` is the queue's most urgent request (None: nothing queued),
        ``pop_top()`` takes that one out of the queue, and ``cut(top())`` is
        how many items the policy would cut from this batch and the queue
        together. Queued requests of its shape join it, most urgent first,
        while they fit in that. Then, if the queue's most urgent request would
        lead a batch cut now (a deadline before all of the batch's) or take a
        member's place (its shape, a deadline before a member's) and could not
        join, the batch is taken back (TAKEN_BACK): the caller puts its
        requests back in the queue and cuts again.
        """
        batch, record = self.batch, self._record
        with record.lock:
            if not record.open:
                return Seen.TAKEN
            head = top()
            if head is None:
                return Seen.STAGED
            key = batch.requests[0].shape_key
            earliest = batch.earliest
            latest = max(r.deadline for r in batch.requests)
            room = cut(head) - batch.size
            while (
                head is not None and room > 0 and head.shape_key == key and head.batch_size <= room
            ):
                _add(batch, pop_top())
                room -= head.batch_size
                head = top()
            if head is not None and (
                head.deadline < earliest or (head.shape_key == key and head.deadline < latest)
            ):
                # A batch cut now would be led by it, or hold it in a member's place,
                # and it cannot join this one: cut again.
                record.retract()
                return Seen.TAKEN_BACK
        return Seen.STAGED

    def drop(self, req: InferenceRequest) -> Seen:
        """Take out ``req``, a member whose client went away, unless an instance
        took the batch: then it ends with its batch, as in any running batch
        (TAKEN). The last member out takes the batch back (TAKEN_BACK): there is
        nothing left to run."""
        batch, record = self.batch, self._record
        with record.lock:
            if not record.open:
                return Seen.TAKEN
            at = batch.requests.index(req)
            del batch.requests[at], batch.parts[at]
            batch.size -= req.batch_size
            if not batch.requests:
                record.retract()
                return Seen.TAKEN_BACK
            batch.earliest = min(r.deadline for r in batch.requests)
        return Seen.STAGED

    def take_back(self) -> bool:
        """Retract it unless an instance took it; True if it did (its requests
        were still waiting, and no instance will run them)."""
        record = self._record
        with record.lock:
            if not record.open:
                return False
            record.retract()
        return True


def _add(batch: Batch, req: InferenceRequest) -> None:
    """``req`` joins ``batch`` (with the lock held, the batch still staged)."""
    batch.requests.append(req)
    batch.parts.append(req.inputs)
    batch.size += req.batch_size
    batch.earliest = min(batch.earliest, req.deadline)
