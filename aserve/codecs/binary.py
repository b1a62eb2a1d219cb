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


# Elements handled per numpy call (or per slice assignment): a large tensor is
# decoded on a worker thread, and short calls let the loop's thread take the
# GIL between them.
CHUNK = 1 << 16


def bytes_elements(buf: memoryview, count: int) -> np.ndarray:
    """Parse exactly ``count`` length-prefixed BYTES elements filling ``buf``.

    Raises ``ValueError`` describing the first inconsistency. When every
    element has the same length (zero-length padding, fixed-width ids) the
    lengths are checked and the elements cut with numpy; otherwise a scan
    reads one length prefix after another.
    """
    end = len(buf)
    if count * 4 > end:
        # Checked before allocating: a lying shape must not cost memory.
        raise ValueError(f"is {end} bytes, too short for {count} elements (4-byte length each)")
    out = np.empty(count, dtype=object)
    if count == 0:
        if end:
            raise ValueError(f"{end} bytes left over after 0 elements")
        return out
    width = _U32.unpack_from(buf, 0)[0]
    if end == count * (4 + width) and _all_of_length(buf, count, width):
        _cut_uniform(out, buf, count, width)
    else:
        _scan(out, buf, count)
    return out


def _all_of_length(buf: memoryview, count: int, width: int) -> bool:
    """Whether every one of ``count`` elements, ``4 + width`` bytes apart, says ``width``."""
    lengths = np.ndarray((count,), dtype="<u4", buffer=buf, strides=(4 + width,))
    for i in range(0, count, CHUNK):
        if not (lengths[i : i + CHUNK] == width).all():
            return False
    return True


def _cut_uniform(out: np.ndarray, buf: memoryview, count: int, width: int) -> None:
    if width == 0:
        for i in range(0, count, CHUNK):
            out[i : i + CHUNK] = b""
        return
    # A void view of the elements' bytes: .tolist() makes them bytes objects
    # (an "S" view would drop trailing NULs).
    items = np.ndarray((count,), dtype=f"V{width}", buffer=buf, offset=4, strides=(4 + width,))
    for i in range(0, count, CHUNK):
        out[i : i + CHUNK] = items[i : i + CHUNK].tolist()


def _scan(out: np.ndarray, buf: memoryview, count: int) -> None:
    unpack = _U32.unpack_from
    end = len(buf)
    pos = 0
    for start in range(0, count, CHUNK):
        stop = min(count, start + CHUNK)
        part = []
        for i in range(start, stop):
            if pos + 4 > end:
                raise ValueError(f"ends inside the length prefix of element {i} of {count}")
            (n,) = unpack(buf, pos)
            pos += 4
            if pos + n > end:
                raise ValueError(f"element {i} declares {n} bytes but only {end - pos} remain")
            part.append(buf[pos : pos + n].tobytes())
            pos += n
        out[start:stop] = part
    if pos != end:
        raise ValueError(f"{end - pos} bytes left over after {count} elements")
