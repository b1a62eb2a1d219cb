"""Named arrays over a pipe to a worker process, as msgpack.

Numeric arrays travel as ``(dtype, shape, raw bytes)``; object arrays (BYTES
tensors) as a flat list of ``bytes``/``str`` items. Nothing is pickled: the
worker and the server exchange plain data only. Layer: ``workers``; used on
both ends of a pipe (the loop, and a child process), it imports no asyncio.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_OBJECT = "O"


class WireError(TypeError):
    """An array cannot cross to or from a worker process; says which and why."""


def pack_arrays(arrays: dict[str, np.ndarray]) -> list[Any]:
    """``[(name, dtype, shape, data), ...]`` for msgpack."""
    out = []
    for name, arr in arrays.items():
        if arr.dtype == object:
            items = arr.reshape(-1).tolist()
            for x in items:
                if not isinstance(x, (bytes, str)):
                    raise WireError(
                        f"array '{name}' holds a {type(x).__name__}; only numeric arrays and "
                        "object arrays of bytes or str can cross to a worker process"
                    )
            out.append((name, _OBJECT, list(arr.shape), items))
        elif arr.dtype.hasobject or arr.dtype.fields is not None:
            raise WireError(f"array '{name}' has dtype {arr.dtype}, which cannot be sent")
        else:
            # A view of the array's memory: msgpack copies it once, into its buffer.
            out.append((name, arr.dtype.str, list(arr.shape), np.ascontiguousarray(arr).data))
    return out


def unpack_arrays(packed: list[Any], writable: bool = False) -> dict[str, np.ndarray]:
    """The arrays :func:`pack_arrays` sent. Numeric ones are views of the message's
    bytes (read-only) unless ``writable``, which copies them."""
    out = {}
    for name, dtype, shape, data in packed:
        if dtype == _OBJECT:
            arr = np.empty(len(data), dtype=object)
            arr[:] = data
            out[name] = arr.reshape(shape)
        else:
            arr = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
            out[name] = arr.copy() if writable else arr
    return out
