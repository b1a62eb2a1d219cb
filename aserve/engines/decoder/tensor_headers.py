"""What safetensors files hold, read from their headers without their data.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the data. The header
alone says how many parameters the files really hold, so a ``config.json``
that implies other weights is refused before a tensor is read or a layer
allocated. The header is checked against the file's size, so what it
declares is what is on disk.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aserve.engines.decoder.spec import CheckpointError

# Real headers are a few hundred bytes per tensor (a 405B-parameter
# checkpoint's largest shard: under 100 KiB); safetensors' own cap is 100 MB.
MAX_HEADER_BYTES = 8 * 2**20

ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@contextmanager
def open_regular(path: Path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``path`` open for reading, with its ``fstat``; :class:`CheckpointError` if it
    cannot be opened or is not a regular file (a FIFO put there never blocks the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        yield f, info


def read_headers(path: Path) -> dict[str, TensorHeader]:
    """The tensors of one safetensors file, by name; :class:`CheckpointError`
    for a header that is too large, malformed, or declares more data than the
    file holds."""
    with open_regular(path) as (f, info):
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: safetensors header of {length} bytes, over the limit of "
                f"{MAX_HEADER_BYTES} bytes"
            )
        if 8 + length > info.st_size:
            raise CheckpointError(f"{path}: the header says {length} bytes; the file is shorter")
        raw = f.read(length)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_bytes = info.st_size - 8 - length
    out: dict[str, TensorHeader] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, entry, data_bytes)
    return out


def _entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorHeader:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor '{name}': {what}")

    if not isinstance(entry, dict):
        raise bad("its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_natural(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [begin, end]")
    header = TensorHeader(dtype, tuple(shape))
    begin, end = offsets
    if end > data_bytes:
        raise bad(f"its data ends at byte {end}, past the file's {data_bytes} bytes of data")
    if end - begin != header.numel * ITEM_BYTES[dtype]:
        raise bad(f"{end - begin} bytes of data for shape {shape} of {dtype}")
    return header


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
