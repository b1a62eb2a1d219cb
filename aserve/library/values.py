"""Call inputs and results as msgpack, for the worker processes of a ``Batched``.

What crosses to a worker is plain data: msgpack's own types (None, bool,
int, float, str, bytes, lists, dicts) and numpy arrays of numbers, which
travel as an extension ``(dtype, shape, raw bytes)``, as
:mod:`aserve.workers.wire` sends them. Nothing is pickled, so a worker never
runs code that a value brought with it. Tuples arrive as lists; numpy scalars
as Python numbers.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_ARRAY = 1  # the msgpack extension code of a numpy array


class NotSendable(TypeError):
    """A value cannot cross to or from a worker process; says what and why."""


def pack_value(value: Any, what: str) -> bytes:
    """``value`` as msgpack; raises :class:`NotSendable` naming ``what`` and the culprit."""
    try:
        return msgpack.packb(value, default=_encode, use_bin_type=True)
    except NotSendable as exc:
        raise NotSendable(f"{what} {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise NotSendable(f"{what} cannot be sent as msgpack: {exc}") from None


def unpack_value(data: bytes) -> Any:
    """The value :func:`pack_value` packed (arrays come back writable)."""
    return msgpack.unpackb(data, ext_hook=_decode, raw=False, strict_map_key=False)


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise NotSendable(
                f"holds a numpy array of dtype {obj.dtype}: only arrays of numbers can cross "
                "to a worker process (never pickles)"
            )
        head = msgpack.packb((obj.dtype.str, list(obj.shape)))
        return msgpack.ExtType(_ARRAY, head + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotSendable(
        f"holds a {type(obj).__module__}.{type(obj).__qualname__}: only None, bool, int, "
        "float, str, bytes, lists, dicts and numpy arrays of numbers can cross to a worker "
        "process (values are sent as msgpack, never pickled)"
    )


def _decode(code: int, data: bytes) -> Any:
    if code != _ARRAY:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    start = unpacker.tell()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=start).reshape(shape).copy()
