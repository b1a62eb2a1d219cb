"""The system shared memory regions clients registered (frontends layer; on the loop).

Triton's system shared memory extension: a client creates a POSIX shared
memory object (``shm_open``; tritonclient's ``create_shared_memory_region``),
registers a region of it by name, key, offset and byte size, and then names
the region in an inference request's inputs and requested outputs instead of
sending their bytes.

A region is mapped once, when it is registered, from a key that names one
object under ``/dev/shm`` (``/name`` or ``name``: no other ``/``, not ``.`` or
``..``), opened without following a symbolic link and only if it is a regular
file that holds the whole region. Requests read inputs from the mapping in
place and write outputs into it.

Each request that names a region holds a use of it (:meth:`SystemSharedMemory.acquire`)
until its answer is encoded. Unregistering takes the region out of the table at
once (a new one may take its name), but the mapping stays until the last use
ends; then it is closed, or, while numpy arrays still view it, left to go when
they do (an mmap with views refuses to close, so nothing is ever read from
memory that was unmapped).

Everything here runs on the loop: no lock. Opening and mapping an object of
a memory file system does no disk I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from aserve.codecs.shm import Release
from aserve.errors import InvalidArgument

SHM_DIR: Final = "/dev/shm"
# What registering CUDA shared memory answers, over both frontends.
NO_GPU: Final = "CUDA shared memory needs a GPU; this server has none"


def _not_found(name: str) -> InvalidArgument:
    # Triton's words, so that clients matching on them keep working.
    return InvalidArgument(f"Unable to find system shared memory region: '{name}'")


@dataclass(slots=True)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    base: int  # where the region begins in the mapping (mmap offsets are page aligned)
    users: int = 0
    unregistered: bool = False

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip


class SystemSharedMemory:
    """The registered regions by name; implements :class:`aserve.codecs.shm.SharedMemory`."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self._dir = directory
        self._regions: dict[str, _Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the object ``key`` as region ``name``.

        :class:`InvalidArgument` for a name already registered, a key that is not
        one object's name, an object that is missing, not a regular file, a
        symbolic link, or too short for the region.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a shared memory region needs a non-empty name")
        if name in self._regions:
            raise InvalidArgument(f"shared memory region '{name}' already in manager")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(
                    f"shared memory region '{name}': '{field}' must be a non-negative integer"
                )
        if byte_size == 0:
            raise InvalidArgument(f"shared memory region '{name}': byte_size must be at least 1")
        path = os.path.join(self._dir, _object_name(key))
        mapping, base = _map(name, key, path, offset, byte_size)
        self._regions[name] = _Region(name, key, offset, byte_size, mapping, base)

    def unregister(self, name: str = "") -> None:
        """Unregister ``name``, or every region when ``name`` is empty; a name not
        registered is no error (as Triton)."""
        names = list(self._regions) if not name else [name] if name in self._regions else []
        for n in names:
            region = self._regions.pop(n)
            region.unregistered = True
            if not region.users:
                _unmap(region)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Every region's ``name``, ``key``, ``offset`` and ``byte_size``, or ``name``'s."""
        if not name:
            return [r.status() for _, r in sorted(self._regions.items())]
        region = self._regions.get(name)
        if region is None:
            raise _not_found(name)
        return [region.status()]

    def acquire(
        self, region: str, offset: int, byte_size: int, what: str
    ) -> tuple[memoryview, Release]:
        found = self._regions.get(region)
        if found is None:
            raise InvalidArgument(f"{what}: {_not_found(region).message}")
        end = offset + byte_size
        if end > found.byte_size:
            raise InvalidArgument(
                f"{what}: shared_memory_offset {offset} + shared_memory_byte_size "
                f"{byte_size} = {end} is past the end of shared memory region '{region}' "
                f"({found.byte_size} bytes)"
            )
        start = found.base + offset
        view = memoryview(found.mapping)[start : start + byte_size]
        # No await between the lookup and the count: unregister cannot come between.
        found.users += 1
        return view, partial(_release, found)

    def in_use(self, name: str) -> int:
        """How many requests hold region ``name`` (registered or not yet unmapped)."""
        region = self._regions.get(name)
        return 0 if region is None else region.users

    def close(self) -> None:
        """Unregister every region (at the server's stop)."""
        self.unregister()


def _object_name(key: Any) -> str:
    """The file name under the directory that ``key`` names (shm_open's form: a
    leading ``/``, then one name)."""
    if not isinstance(key, str):
        raise InvalidArgument("shared memory 'key' must be a string")
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidArgument(
            f"shared memory key {key!r} must name one object under {SHM_DIR} "
            "(like '/my_region'): one name, no '/' inside it, not '.' or '..'"
        )
    return name


def _map(name: str, key: str, path: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InvalidArgument(
            f"shared memory region '{name}': key '{key}' names no object under {SHM_DIR}"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the name is a symbolic link
            reason = "is a symbolic link"
        else:
            reason = f"cannot be opened: {exc.strerror}"
        raise InvalidArgument(f"shared memory region '{name}': key '{key}' {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(
                f"shared memory region '{name}': key '{key}' is not a shared memory object"
            )
        end = offset + byte_size
        if end > info.st_size:
            raise InvalidArgument(
                f"shared memory region '{name}': offset {offset} + byte_size {byte_size} = "
                f"{end} is past the end of key '{key}' ({info.st_size} bytes)"
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, end - start, mmap.MAP_SHARED, offset=start)
        except OSError as exc:
            raise InvalidArgument(
                f"shared memory region '{name}': key '{key}' cannot be mapped: {exc.strerror}"
            ) from None
    finally:
        os.close(fd)  # the mapping keeps its own
    return mapping, offset - start


def _release(region: _Region) -> None:
    region.users -= 1
    if region.unregistered and not region.users:
        _unmap(region)


def _unmap(region: _Region) -> None:
    try:
        region.mapping.close()
    except BufferError:
        pass  # numpy arrays still view it: unmapped when the last of them goes
