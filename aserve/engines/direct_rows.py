"""A ``direct`` sequence model's batch: each request at its sequence's row, padding between.

Layer: ``engines``; runs where the engine runs (an instance thread, or the loop
for an inline batch); never asyncio. :class:`DirectRows` wraps the model's
engine: its ``stack_inputs`` reads each request's slot (under
:data:`~aserve.sched.direct.SLOT_KEY`) and lays the batch out as
:func:`aserve.sched.direct.layout` says; its ``run`` runs the model on that
batch and gives back each request's own row, in the batch's order, so the
batcher slices the outputs as for any batch and padding rows' outputs are
dropped (they update no one's state).

A padding row holds zeros in every input (BYTES: empty), so its READY, START
and END controls are 0 and its CORRID 0 or empty; an implicit state input
holds the kept state of the sequence that owns the row (idle in this batch),
else the state's initial value (a free row): a model that reads the state
even where READY is 0 then sees what the row's sequence will see next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aserve.engines.base import Engine
from aserve.sched.direct import SLOT_KEY, layout

# Where the stacked batch carries its requests' rows from stack_inputs to run.
_ROWS_KEY = "\x00sequence_rows"


class DirectRows:
    """``engine`` with its batches laid out by sequence row; every other attribute is
    the engine's own (loading, instances, parking, inline runs).

    ``initial`` maps each implicit state input to its initial value (one row);
    ``kept(slot)`` returns the implicit states kept for the sequence on
    ``slot`` (None: a free slot, or one whose sequence has none yet). It is
    read on instance threads while the loop replaces its entries: each entry
    is a fresh dict of fresh arrays, never changed in place.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int,
        initial: Mapping[str, np.ndarray],
        kept: Callable[[int], Mapping[str, np.ndarray] | None],
    ) -> None:
        self.engine = engine
        self._max = max_batch_size
        self._initial = dict(initial)
        self._kept = kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def stack_inputs(self, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The padded batch; parts without a slot (warm-up's) are stacked as they are."""
        if not parts or SLOT_KEY not in parts[0]:
            return self.engine.stack_inputs(parts)
        slots = [int(p[SLOT_KEY]) for p in parts]
        rows = layout(slots, self._max)
        base = slots[0] - rows.rows[0]  # the instance's first slot
        full: list[dict[str, np.ndarray] | None] = [None] * rows.size
        for part, row in zip(parts, rows.rows, strict=True):
            full[row] = part
        for row in rows.padding:
            full[row] = self._padding(parts[0], self._kept(base + row))
        stacked = self.engine.stack_inputs(full)  # type: ignore[arg-type]
        stacked[_ROWS_KEY] = np.array(rows.rows, dtype=np.intp)
        return stacked

    def _padding(
        self, like: dict[str, np.ndarray], kept: Mapping[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """One padding row, shaped like a real request's (one batch has one shape)."""
        row: dict[str, np.ndarray] = {}
        for name, arr in like.items():
            if name == SLOT_KEY:
                continue
            if name in self._initial:
                state = kept.get(name) if kept is not None else None
                row[name] = self._initial[name] if state is None else state
            elif arr.dtype == object:
                empty = np.empty((1, *arr.shape[1:]), dtype=object)
                empty.fill(b"")
                row[name] = empty
            else:
                row[name] = np.zeros((1, *arr.shape[1:]), dtype=arr.dtype)
        return row

    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        """Run the batch; with rows laid out, each request's row only, in its order."""
        rows = inputs.pop(_ROWS_KEY, None)
        outputs = self.engine.run(inputs, instance)
        if rows is None:
            return outputs
        return {name: arr[rows] for name, arr in outputs.items()}

    def check_outputs(self, outputs: dict[str, np.ndarray], batch_size: int) -> None:
        self.engine.check_outputs(outputs, batch_size)
