"""Stacking request inputs into one batch and checking what the model returned.

Runs on executor threads: the loop only slices the outputs back apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aserve.config import TensorSpec
from aserve.types.tensors import dtype_fits, shape_fits, shape_text


def stack_inputs(
    parts: Sequence[dict[str, np.ndarray]], specs: Sequence[TensorSpec]
) -> dict[str, np.ndarray]:
    """Concatenate each input along the batch dimension, in request order."""
    if len(parts) == 1:
        only = parts[0]
        # Arrays decoded straight from a request body are read-only views;
        # torch wants memory it may write to.
        return {s.name: _writable(only[s.name]) for s in specs}
    return {s.name: np.concatenate([p[s.name] for p in parts]) for s in specs}


def _writable(arr: np.ndarray) -> np.ndarray:
    return arr if arr.flags.writeable else arr.copy()


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
