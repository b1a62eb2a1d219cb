"""Triton's system shared memory extension, the codecs' side: tensors that name a region.

An input or a requested output whose parameters carry ``shared_memory_region``
(with ``shared_memory_byte_size`` and, optionally, ``shared_memory_offset``)
has its bytes in a region the client registered beforehand, in the binary
extension's layout (BYTES: each element a little-endian uint32 length, then
its bytes). The registry of regions is the frontends' (it maps files, and
lives on the loop); the codecs see it through :class:`SharedMemory` only.

Each use of a region, from decoding to the answer, holds it: a region
unregistered meanwhile stays mapped until the last request that uses it ends.
The codecs collect the functions that end those uses in the decoded request,
and the frontend calls them once the answer is encoded.

Layer ``codecs`` (no torch, no asyncio); called on the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np

from aserve.codecs.binary import tensor_to_bytes
from aserve.errors import InvalidArgument, Unimplemented
from aserve.types.tensors import numpy_dtype

REGION: Final = "shared_memory_region"
BYTE_SIZE: Final = "shared_memory_byte_size"
OFFSET: Final = "shared_memory_offset"

Release = Callable[[], None]


class SharedMemory(Protocol):
    """The registered regions, as a codec uses them (on the loop)."""

    def acquire(
        self, region: str, offset: int, byte_size: int, what: str
    ) -> tuple[memoryview, Release]:
        """A writable view of ``byte_size`` bytes at ``offset`` in ``region``, and the
        function that ends this use of it (call it once).

        Raises :class:`InvalidArgument` naming ``what`` (``"input 'x'"``) when the
        region is not registered or the bytes lie outside it.
        """
        ...


@dataclass(frozen=True, slots=True)
class OutputTarget:
    """Where a requested output goes: a view of its bytes in the client's region."""

    region: str
    offset: int
    view: memoryview  # writable, shared_memory_byte_size bytes long

    def parameters(self, written: int) -> dict[str, Any]:
        """What the answer says of the output instead of its data."""
        params: dict[str, Any] = {REGION: self.region, BYTE_SIZE: written}
        if self.offset:
            params[OFFSET] = self.offset
        return params


def tensor_region(params: Mapping[str, Any], what: str) -> tuple[str, int, int]:
    """The region, offset and byte size a tensor's parameters name, checked."""
    region = params.get(REGION)
    if not isinstance(region, str) or not region:
        raise InvalidArgument(f"{what}: parameter '{REGION}' must be a non-empty string")
    size = params.get(BYTE_SIZE)
    if type(size) is not int or size < 0:  # exactly int: not a bool
        raise InvalidArgument(
            f"{what}: parameter '{BYTE_SIZE}' must be a non-negative integer "
            f"(it goes with '{REGION}')"
        )
    offset = params.get(OFFSET, 0)
    if type(offset) is not int or offset < 0:
        raise InvalidArgument(f"{what}: parameter '{OFFSET}' must be a non-negative integer")
    return region, offset, size


def acquire(
    shm: SharedMemory | None, params: Mapping[str, Any], what: str, held: list[Release]
) -> tuple[str, int, memoryview]:
    """The region, offset and view of a tensor's bytes; the use is appended to ``held``.

    :class:`Unimplemented` when this path of the server takes no shared memory
    (``shm`` None).
    """
    if shm is None:
        raise Unimplemented(f"{what}: shared memory is not supported here")
    region, offset, size = tensor_region(params, what)
    view, release = shm.acquire(region, offset, size, what)
    held.append(release)
    return region, offset, view


def release_all(held: list[Release]) -> None:
    """End every use in ``held`` (and empty it)."""
    while held:
        held.pop()()


def check_room(name: str, datatype: str, shape: list[int], target: OutputTarget) -> None:
    """Refuse, before the request is queued, an output whose size its model fixes
    (no ``-1`` in ``shape``, batch included; not BYTES) and that cannot fit its region."""
    if datatype == "BYTES" or -1 in shape:
        return  # known only once the model has answered: write_output checks it
    size = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(datatype).itemsize
    _fits(name, size, shape, target)


def _fits(name: str, size: int, shape: list[int], target: OutputTarget) -> None:
    room = len(target.view)
    if size > room:
        raise InvalidArgument(
            f"output '{name}' is {size} bytes (shape {shape}), more than the "
            f"{room} bytes of {BYTE_SIZE} it was given in shared memory region "
            f"'{target.region}'"
        )


def write_output(name: str, arr: np.ndarray, target: OutputTarget) -> int:
    """Write ``arr`` into its region, once; returns the bytes written.

    :class:`InvalidArgument` when it does not fit (nothing is written then).
    """
    raw: bytes | None = None
    if arr.dtype.kind in "OSU":
        raw = tensor_to_bytes(arr)
        size = len(raw)
    else:
        size = arr.nbytes
    _fits(name, size, list(arr.shape), target)
    if raw is not None:
        target.view[:size] = raw
    elif size:
        # Straight into the region: numpy converts the layout (strides, byte order)
        # as it copies, so the bytes are written once.
        dst = np.frombuffer(target.view, dtype=arr.dtype.newbyteorder("<"), count=arr.size)
        np.copyto(dst.reshape(arr.shape), arr)
    return size
