"""Stacking request inputs into one batch and checking what the model returned.

Layer: ``engines``. Runs where the engine runs (an executor thread, a worker
process); the loop only slices the outputs back apart. :func:`stack_inputs`
and :func:`engine_check_outputs` are :class:`~aserve.engines.base.Engine`'s
default ``stack_inputs`` and ``check_outputs`` themselves (bound there as
methods), so a batch makes no forwarding call into ``base``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from aserve.config import TensorSpec
from aserve.types.tensors import dtype_fits, shape_fits, shape_text

if TYPE_CHECKING:
    from aserve.engines.base import Engine


def stack_inputs(engine: Engine, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from the requests' inputs: each input of ``engine``'s config
    concatenated along the batch dimension, in request order."""
    specs = engine.config.inputs
    if len(parts) == 1:
        only = parts[0]
        # Arrays decoded straight from a request body are read-only views;
        # torch wants memory it may write to.
        return {s.name: _writable(only[s.name]) for s in specs}
    return {s.name: np.concatenate([p[s.name] for p in parts]) for s in specs}


def _writable(arr: np.ndarray) -> np.ndarray:
    return arr if arr.flags.writeable else arr.copy()


def engine_check_outputs(engine: Engine, outputs: dict[str, np.ndarray], batch_size: int) -> None:
    """Raise ``ValueError`` naming the output when ``engine``'s ``run`` broke its config."""
    check_outputs(outputs, engine.config.outputs, batch_size, engine.config.name)


def check_outputs(
    outputs: dict[str, np.ndarray], specs: Sequence[TensorSpec], batch_size: int, model: str
) -> None:
    """Raise ``ValueError`` naming the output when the model broke its declared contract."""
    for spec in specs:
        arr = outputs.get(spec.name)
        if arr is None:
            raise ValueError(f"model '{model}' did not produce output '{spec.name}'")
        if not dtype_fits(arr.dtype, spec.datatype):
            raise ValueError(
                f"model '{model}' output '{spec.name}' has dtype {arr.dtype}, "
                f"but the config declares {spec.datatype}"
            )
        if not shape_fits(arr.shape, spec.shape, batch_size):
            raise ValueError(
                f"model '{model}' output '{spec.name}' has shape {list(arr.shape)}, expected "
                f"{shape_text(spec.shape, batch_size)} for a batch of {batch_size}"
            )
