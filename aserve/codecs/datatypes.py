"""KServe V2 datatype names and their numpy equivalents.

BYTES tensors are numpy object arrays whose elements are ``bytes``.
"""

from __future__ import annotations

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

NUMPY_TO_V2: Final[dict[np.dtype, str]] = {v: k for k, v in V2_TO_NUMPY.items()}

DATATYPES: Final[tuple[str, ...]] = tuple(V2_TO_NUMPY)


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a V2 datatype name (``KeyError`` if unknown)."""
    return V2_TO_NUMPY[datatype]


def v2_datatype(dtype: np.dtype) -> str:
    """The V2 name of a numpy dtype; str/bytes arrays map to BYTES."""
    if dtype.kind in "OSU":
        return "BYTES"
    return NUMPY_TO_V2[np.dtype(dtype)]
