"""Raw tensor bytes: the binary tensor data extension's element encoding.

Numbers are little-endian, row-major, native width; BOOL is one byte; a BYTES
tensor is its elements concatenated, each a little-endian uint32 length then
that many bytes.
"""

from __future__ import annotations

import struct

import numpy as np

_U32 = struct.Struct("<I")


def tensor_to_bytes(arr: np.ndarray) -> bytes:
    """Serialize a tensor's elements in the binary extension's layout."""
    if arr.dtype.kind == "O" or arr.dtype.kind in "SU":
        parts = []
        for item in arr.ravel():
            b = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(_U32.pack(len(b)))
            parts.append(b)
        return b"".join(parts)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes()


def bytes_elements(buf: memoryview, count: int) -> np.ndarray:
    """Parse exactly ``count`` length-prefixed BYTES elements filling ``buf``.

    Raises ``ValueError`` describing the first inconsistency.
    """
    end = len(buf)
    if count * 4 > end:
        # Checked before allocating: a lying shape must not cost memory.
        raise ValueError(f"is {end} bytes, too short for {count} elements (4-byte length each)")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > end:
            raise ValueError(f"ends inside the length prefix of element {i} of {count}")
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + n > end:
            raise ValueError(f"element {i} declares {n} bytes but only {end - pos} remain")
        out[i] = bytes(buf[pos : pos + n])
        pos += n
    if pos != end:
        raise ValueError(f"{end - pos} bytes left over after {count} elements")
    return out
