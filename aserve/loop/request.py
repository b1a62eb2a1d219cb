"""One inference request as the loop sees it: inputs, deadline, and its future.

A request is created by a frontend after validation, owned by the loop, and
answered exactly once through its future. Only loop code touches it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np

_ids = itertools.count(1)


class InferenceRequest:
    """A validated request for one model.

    ``inputs`` hold whole tensors including the batch dimension; ``batch_size``
    is that leading dimension, which the batcher counts against
    ``max_batch_size``. ``shape_key`` groups requests whose non-batch shapes
    match, since only those can be stacked together. ``deadline`` and
    ``arrival`` are ``time.monotonic()`` seconds.
    """

    __slots__ = (
        "arrival",
        "batch_size",
        "client_id",
        "compute_ns",
        "deadline",
        "dispatched",
        "future",
        "inputs",
        "parameters",
        "predicted",
        "queued",
        "seq",
        "shape_key",
    )

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        arrival: float,
        deadline: float,
        future: asyncio.Future[dict[str, np.ndarray]],
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self.seq = next(_ids)  # server-side id: log lines and FIFO tie-break
        self.client_id = client_id
        self.inputs = inputs
        self.batch_size = batch_size
        self.shape_key = shape_key
        self.arrival = arrival
        self.deadline = deadline
        self.future = future
        self.parameters = parameters
        self.queued = False  # True while it sits in a batcher's queue
        self.dispatched = 0.0  # when its batch went to an executor (0: not yet)
        self.compute_ns = 0  # its batch's time in the engine, once answered
        self.predicted = 0.0  # when admission expected it done (0: nothing measured yet)

    def __lt__(self, other: InferenceRequest) -> bool:
        # Heap order: earliest deadline first, then first come.
        return (self.deadline, self.seq) < (other.deadline, other.seq)

    @property
    def log_id(self) -> str:
        return f"{self.seq}" if self.client_id is None else f"{self.seq}/{self.client_id}"
