"""A request's place in its sequence (sequence batching), as a handler sees it.

Layer: types. Plain data, torch-free: the loop makes one per request of a
sequence-batched model, a python handler reads it as ``request.sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A sequence's id: a positive integer below 2**64, or a non-empty string.
SequenceId = int | str


@dataclass(frozen=True)
class SequenceInfo:
    """One request of a sequence: which sequence, whether it starts or ends it.

    ``state`` is the sequence's own dict, the same object for each of its
    requests, kept by the server from the start to the end (or until the
    sequence is freed for being idle): a handler keeps what the next request
    needs in it. A sequence's requests run one at a time, so a handler's
    ``preprocess`` and ``postprocess`` never see it from two threads at once.
    ``slot`` is the sequence's slot, from 0 to the number of slots less one,
    fixed for its life (another sequence may hold it afterwards).
    """

    id: SequenceId
    start: bool
    end: bool
    slot: int
    state: dict[str, Any] = field(default_factory=dict, compare=False)
