"""KServe V2 datatype names, their numpy equivalents, and the one check of a tensor
against a declared datatype and shape.

Layer ``types`` (no torch, no asyncio): pure functions, called on the loop and on
executor threads alike. BYTES tensors are numpy object arrays whose elements are
``bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

V2_TO_NUMPY: Final[dict[str, np.dtype]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

DATATYPES: Final[tuple[str, ...]] = tuple(V2_TO_NUMPY)


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a V2 datatype name (``KeyError`` if unknown)."""
    return V2_TO_NUMPY[datatype]


def dtype_fits(dtype: np.dtype, datatype: str) -> bool:
    """Whether an array of ``dtype`` carries ``datatype``: its own numpy dtype, or for
    BYTES any object, bytes or str array (the codecs encode all three)."""
    want = V2_TO_NUMPY[datatype]
    return dtype == want or (want.kind == "O" and dtype.kind in "OSU")


def shape_fits(shape: Sequence[int], dims: Sequence[int], batch_size: int | None = None) -> bool:
    """Whether ``shape`` is ``[batch, *dims]``: ``-1`` in ``dims`` takes any size, and
    the batch dimension must be ``batch_size`` (any, when None)."""
    if len(shape) != len(dims) + 1 or (batch_size is not None and shape[0] != batch_size):
        return False
    for want, got in zip(dims, shape[1:], strict=True):
        if want != -1 and want != got:
            return False
    return True


def shape_text(dims: Sequence[int], batch_size: int | None = None) -> str:
    """``[batch, *dims]`` for a message: ``[4, 16]``, or ``[batch, -1]`` with no batch size."""
    head = "batch" if batch_size is None else str(batch_size)
    return f"[{', '.join([head, *map(str, dims)])}]"
