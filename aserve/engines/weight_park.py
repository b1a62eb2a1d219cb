"""A TorchScript module's weights released while its compiled module is kept,
and read back from its file: an evicted model's reload without a load.

Layer: ``engines``; runs on a thread off the loop (an eviction, a load).

``torch.jit.load`` holds the GIL for the whole deserialization (several ms
for a small MLP, and the first batches after it pay TorchScript's profiling
and optimization): under a memory budget, where models are loaded and
evicted several times a second, every load stalls the loop and every other
model's batches. Parking keeps the module (its code, its optimized graph,
its batcher's latency estimates) and releases only the storages of its
parameters and buffers; restoring reads each storage's bytes back from the
file with ``os.preadv``, which releases the GIL, into a new storage that
the same tensors point at again.

Which bytes of the file each storage came from is found once, at the first
park: a TorchScript file is a zip whose ``<archive>/data/<key>`` records
hold the storages uncompressed; a storage is matched to a record of its
size whose bytes hash the same (blake2b). A storage that matches no record
(a module that changed its weights after load, say) is kept, not released.
The file is checked at each restore (size, modification time, inode): a
file changed since the load refuses the restore, and the caller loads anew.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aserve.engines.base import ParkError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip's local file header, 30 bytes
_DIGEST = 16


@dataclass
class _Storage:
    offset: int  # of its bytes in the file
    nbytes: int
    # Each tensor that views it: (tensor, storage_offset, size, stride), in elements.
    views: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]]


class WeightPark:
    """The plan of a loaded TorchScript module's storages against its file; see
    the module's docstring. Made by :meth:`plan` while the weights are loaded."""

    def __init__(self, path: Path, stat: os.stat_result, storages: list[_Storage]) -> None:
        self.path = path
        self._stat = _identity(stat)
        self._storages = storages
        self.parked = False

    @property
    def nbytes(self) -> int:
        """The bytes that :meth:`release` frees (those matched in the file)."""
        return sum(s.nbytes for s in self._storages)

    @classmethod
    def plan(cls, module: Any, path: Path) -> WeightPark | None:
        """The plan for ``module`` (as loaded from ``path``), or None when none of
        its storages can be found in the file (not a TorchScript zip, say)."""
        stat = path.stat()
        try:
            records = _records(path)
        except (OSError, zipfile.BadZipFile, struct.error):
            return None
        by_size: dict[int, list[int]] = {}
        for offset, nbytes in records:
            by_size.setdefault(nbytes, []).append(offset)
        digests: dict[int, bytes] = {}  # record offset -> digest, read once
        grouped: dict[int, _Storage] = {}
        with open(path, "rb", buffering=0) as f:
            for t in module.state_dict(keep_vars=True).values():
                if (
                    not isinstance(t, torch.Tensor)
                    or t.is_sparse
                    or t.is_quantized
                    or t.untyped_storage().nbytes() == 0
                ):
                    continue  # kept as it is
                storage = t.untyped_storage()
                key = storage.data_ptr()
                view = (t, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
                if key in grouped:
                    grouped[key].views.append(view)
                    continue
                offsets = by_size.get(storage.nbytes(), [])
                if not offsets:
                    continue
                mine = _digest_storage(storage)
                for offset in offsets:
                    if offset not in digests:
                        digests[offset] = _digest_file(f, offset, storage.nbytes())
                    if digests[offset] == mine:
                        grouped[key] = _Storage(offset, storage.nbytes(), [view])
                        break
        if not grouped:
            return None
        return cls(path, stat, list(grouped.values()))

    def release(self) -> int:
        """Point every planned tensor at an empty storage; the bytes freed (once
        nothing else holds the old storages)."""
        with torch.no_grad():
            for s in self._storages:
                for t, *_ in s.views:
                    t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        self.parked = True
        return self.nbytes

    def restore(self, device: torch.device) -> None:
        """Read every released storage back from the file onto ``device``, and point
        its tensors at it; :class:`ParkError` when the file changed since the plan
        or a read fails (the module stays released: the caller loads anew)."""
        try:
            now = _identity(self.path.stat())
        except OSError as exc:
            raise ParkError(f"the model file cannot be read again: {exc}") from None
        if now != self._stat:
            raise ParkError(f"the model file {self.path.name} changed since it was loaded")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            with torch.no_grad():
                for s in self._storages:
                    host = torch.empty(s.nbytes, dtype=torch.uint8)
                    got = os.preadv(fd, [memoryview(host.numpy())], s.offset)
                    if got != s.nbytes:
                        raise ParkError(
                            f"the model file {self.path.name} ended early at byte {s.offset + got}"
                        )
                    data = host if device.type == "cpu" else host.to(device)
                    for t, offset, size, stride in s.views:
                        t.set_(data.untyped_storage(), offset, size, stride)
        finally:
            os.close(fd)
        self.parked = False


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _records(path: Path) -> list[tuple[int, int]]:
    """(offset of the bytes, size) of each stored storage record of a TorchScript zip."""
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data" or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            header = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if header[0] != b"PK\x03\x04":
                continue
            name_len, extra_len = header[-2], header[-1]
            out.append(
                (info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size)
            )
    return out


def _digest_storage(storage: torch.UntypedStorage) -> bytes:
    data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if data.device.type != "cpu":
        data = data.cpu()
    return hashlib.blake2b(memoryview(data.numpy()), digest_size=_DIGEST).digest()


def _digest_file(f: Any, offset: int, nbytes: int, chunk: int = 8 << 20) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    buf = bytearray(min(chunk, nbytes))
    view = memoryview(buf)
    left, at = nbytes, offset
    while left:
        n = os.preadv(f.fileno(), [view[: min(left, len(buf))]], at)
        if n <= 0:
            return b""  # ended early: matches nothing
        h.update(view[:n])
        left, at = left - n, at + n
    return h.digest()
