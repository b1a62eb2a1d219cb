"""The rings between a frontend process and the core, and their doorbells (frontends layer;
loop side, in both processes).

Each frontend has two :class:`~aserve.codecs.ring.Ring` s in shared memory
(a ``memfd`` each, made by the core and inherited by the frontend): requests
(frontend to core) and answers (core to frontend). Each ring has two
``eventfd`` s: its *bell*, which the producer rings after writing, and its
*room*, which the consumer rings after releasing room while the producer
waits for some.

- :class:`RingSender` (the producer): :meth:`~RingSender.send` writes a message
  and rings the bell once per turn of the loop, however many messages the
  turn wrote (``call_soon``); a full ring makes the sender wait for room,
  never drops.
- :class:`RingReceiver` (the consumer): on the bell, every message in the ring
  is handed to ``on_message`` in order (a view into the ring, valid during
  the call only), then their room is released at once.

A record on either ring is a 4-byte length, a msgpack header of that length,
then the raw bytes the header describes (:func:`frame` and :func:`unframe`).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from aserve.codecs.ring import Ring, ring_bytes

RING_CAPACITY_BYTES = 8 * 1024 * 1024  # each way, per frontend
# A producer waiting for room looks again this often too: the consumer rings the
# room bell when it sees the waiting flag, and a flag set as it looked is seen next time.
_ROOM_RECHECK_S = 0.005
_HEADER_LENGTH = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class RingFds:
    """The descriptors of one ring: its memory, its bell, its room."""

    memory: int
    bell: int
    room: int

    def all(self) -> list[int]:
        return [self.memory, self.bell, self.room]

    def close(self) -> None:
        for fd in self.all():
            os.close(fd)


def new_ring_fds(name: str, capacity: int = RING_CAPACITY_BYTES) -> RingFds:
    """A new zeroed ring's memory and its two eventfds (the core makes them)."""
    memory = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(memory, ring_bytes(capacity))
    flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
    return RingFds(memory, os.eventfd(0, flags), os.eventfd(0, flags))


def map_ring(fds: RingFds) -> Ring:
    """The ring in ``fds.memory``, mapped into this process."""
    size = os.fstat(fds.memory).st_size
    return Ring(memoryview(mmap.mmap(fds.memory, size)))


def frame(header: dict[str, Any], data: Sequence[bytes | memoryview] = ()) -> list[Any]:
    """A record's parts: its header's length, the header (msgpack), then ``data``."""
    packed = msgpack.packb(header)
    return [_HEADER_LENGTH.pack(len(packed)), packed, *data]


def unframe(view: memoryview) -> tuple[dict[str, Any], memoryview]:
    """A record's header and the view of the bytes after it (in the ring: copy what you keep)."""
    (n,) = _HEADER_LENGTH.unpack_from(view, 0)
    return msgpack.unpackb(view[4 : 4 + n]), view[4 + n :]


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


class RingSender:
    """The producer's side of a ring, on the loop."""

    def __init__(self, ring: Ring, fds: RingFds) -> None:
        self._ring = ring
        self._fds = fds
        self._loop = asyncio.get_running_loop()
        self._bell_due = False
        self._room: asyncio.Future[None] | None = None
        self.max_message = ring.max_message

    def try_send(self, parts: Sequence[Any]) -> bool:
        """Write one message now, if there is room (the bell rings at the end of this turn)."""
        if not self._ring.try_write(parts):
            return False
        if not self._bell_due:
            self._bell_due = True
            self._loop.call_soon(self._ring_bell)
        return True

    async def send(self, parts: Sequence[Any]) -> None:
        """Write one message, waiting for room while the ring is full."""
        while not self.try_send(parts):
            await self._wait_room()

    def _ring_bell(self) -> None:
        self._bell_due = False
        try:
            os.eventfd_write(self._fds.bell, 1)
        except OSError:  # closed: the other side is gone
            pass

    async def _wait_room(self) -> None:
        if self._room is None:
            self._room = self._loop.create_future()
            self._ring.producer_waiting = True
            self._loop.add_reader(self._fds.room, self._on_room)
        try:
            await asyncio.wait_for(asyncio.shield(self._room), _ROOM_RECHECK_S)
        except TimeoutError:
            pass

    def _on_room(self) -> None:
        _drain_eventfd(self._fds.room)
        self._loop.remove_reader(self._fds.room)
        self._ring.producer_waiting = False
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def close(self) -> None:
        if self._room is not None:
            self._loop.remove_reader(self._fds.room)
            self._room.cancel()
            self._room = None


class RingReceiver:
    """The consumer's side of a ring, on the loop: ``on_message(view)`` for each message."""

    def __init__(self, ring: Ring, fds: RingFds, on_message: Callable[[memoryview], None]) -> None:
        self._ring = ring
        self._fds = fds
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._reading = False

    def start(self) -> None:
        self._loop.add_reader(self._fds.bell, self._on_bell)
        self._reading = True
        self._on_bell()  # what was written before the reader was in place

    def _on_bell(self) -> None:
        # The bell first: a message written after this read rings it again.
        _drain_eventfd(self._fds.bell)
        ring = self._ring
        on_message = self._on_message
        try:
            while (view := ring.read()) is not None:
                on_message(view)
        finally:
            ring.release()
            if ring.producer_waiting:
                try:
                    os.eventfd_write(self._fds.room, 1)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fds.bell)
