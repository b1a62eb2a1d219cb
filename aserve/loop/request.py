"""One inference request as the loop sees it: inputs, deadline, and its future.

A request is created by a frontend after validation, owned by the loop, and
answered exactly once through its future. Only loop code touches it
(layer: loop).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_ids = itertools.count(1)


@dataclass(slots=True, eq=False, repr=False)
class InferenceRequest:
    """A validated request for one model.

    ``inputs`` hold whole tensors including the batch dimension; ``batch_size``
    is that leading dimension, which the batcher counts against
    ``max_batch_size``. ``shape_key`` groups requests whose non-batch shapes
    match, since only those can be stacked together. ``deadline`` and
    ``arrival`` are ``time.monotonic()`` seconds.

    A dataclass: its ``__init__`` is generated, with nothing of ours to run
    per request; equality stays identity and repr the default (no arrays printed).
    """

    inputs: dict[str, np.ndarray]
    batch_size: int
    shape_key: tuple[Any, ...]
    arrival: float
    deadline: float
    future: asyncio.Future[dict[str, np.ndarray]]
    client_id: str | None = None
    parameters: dict[str, Any] | None = None
    # server-side id: log lines and FIFO tie-break
    seq: int = field(init=False, default_factory=_ids.__next__)
    queued: bool = field(init=False, default=False)  # True while it sits in a batcher's queue
    # when its batch went to an executor (0: not yet)
    dispatched: float = field(init=False, default=0.0)
    compute_ns: int = field(init=False, default=0)  # its batch's time in the engine, once answered
    # when admission expected it done (0: nothing measured yet)
    predicted: float = field(init=False, default=0.0)
    # Its priority level: 1 is the highest, and every request of a model without
    # levels; a DELAY level's request past its deadline drops below them all.
    level: int = field(init=False, default=1)

    def __lt__(self, other: InferenceRequest) -> bool:
        # Heap order: the higher level first, then earliest deadline, then first come.
        return (self.level, self.deadline, self.seq) < (other.level, other.deadline, other.seq)

    @property
    def log_id(self) -> str:
        return f"{self.seq}" if self.client_id is None else f"{self.seq}/{self.client_id}"
