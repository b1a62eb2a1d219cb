"""A single-producer single-consumer ring of messages in shared memory (codecs layer: pure
bytes, no asyncio, no system calls but the mapping's).

Two processes map the same memory (a ``memfd`` here): one writes messages,
the other reads them, each keeping its own position; the counters at the
front of the memory are how each learns the other's:

- bytes ``0:8``: ``head``, every byte the producer has written (a count that
  only grows; its position in the data is ``head % capacity``);
- bytes ``8:16``: ``tail``, every byte the consumer has released;
- bytes ``16:20``: the producer is waiting for room (1) or not (0).

A message is a 4-byte little-endian length then that many bytes, the next
one starting at the following multiple of 8. One that would not fit before
the end of the data starts again at its front, after a wrap mark
(:data:`WRAP`, where there is room for one; the rest of the data is skipped
either way). A message is never split, so that the consumer reads it in place,
as one ``memoryview``; hence :attr:`Ring.max_message`, half the capacity less
the framing, which always fits once the ring is empty.

The producer writes the message first and the new ``head`` last, the consumer
reads ``head`` first and the message after (and releases with ``tail`` last
once done with it): the counters are aligned 8-byte stores, which x86-64 and
ARM64 make whole. Whoever reads a counter the other side is changing sees the
old or the new value, both safe: too little room (the producer waits) or
nothing new yet (the consumer is told again by the doorbell).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

HEADER_BYTES = 64  # the counters, and the data aligned after them
_COUNTER = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
WRAP = 0xFFFFFFFF  # in a length's place: the next message is at the data's front
_ALIGN = 8


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def ring_bytes(capacity: int) -> int:
    """The memory a ring of ``capacity`` bytes of data needs (a multiple of 8)."""
    return HEADER_BYTES + capacity


class Ring:
    """One side of a ring over ``buf`` (``ring_bytes(capacity)`` bytes, zeroed when new):
    the producer calls :meth:`try_write`, the consumer :meth:`read` and :meth:`release`."""

    def __init__(self, buf: memoryview) -> None:
        capacity = len(buf) - HEADER_BYTES
        if capacity <= 0 or capacity % _ALIGN:
            raise ValueError(f"a ring needs a multiple of {_ALIGN} bytes of data, not {capacity}")
        self._buf = buf
        self._data = buf[HEADER_BYTES:]
        self.capacity = capacity
        self.max_message = capacity // 2 - 2 * _ALIGN
        self._read_end = 0  # the consumer's: where the messages read but not released end

    # --- the counters ------------------------------------------------------------

    def _head(self) -> int:
        return _COUNTER.unpack_from(self._buf, 0)[0]

    def _tail(self) -> int:
        return _COUNTER.unpack_from(self._buf, 8)[0]

    @property
    def producer_waiting(self) -> bool:
        return self._buf[16] == 1

    @producer_waiting.setter
    def producer_waiting(self, waiting: bool) -> None:
        self._buf[16] = 1 if waiting else 0

    # --- the producer's side -------------------------------------------------------

    def try_write(self, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        """Write one message, the concatenation of ``parts``; False when there is no
        room for it now (nothing written: wait for the consumer and try again).
        A message over :attr:`max_message` raises :class:`ValueError`."""
        size = 0
        for part in parts:
            size += len(part)
        if size > self.max_message:
            raise ValueError(f"a message of {size} bytes is over the ring's {self.max_message}")
        head, tail = self._head(), self._tail()
        capacity = self.capacity
        at = head % capacity
        need = _aligned(4 + size)
        skip = 0
        if at + need > capacity:  # not before the end: from the front, after a wrap mark
            skip = capacity - at
        if head + skip + need - tail > capacity:
            return False
        data = self._data
        if skip:
            if skip >= 4:
                _LENGTH.pack_into(data, at, WRAP)
            at = 0
        _LENGTH.pack_into(data, at, size)
        pos = at + 4
        for part in parts:
            n = len(part)
            data[pos : pos + n] = part
            pos += n
        _COUNTER.pack_into(self._buf, 0, head + skip + need)  # last: the message is whole
        return True

    # --- the consumer's side -------------------------------------------------------

    def read(self) -> memoryview | None:
        """The next message, in place (valid until :meth:`release`), or None when
        there is none now. Messages read and not released stay in the ring."""
        head = self._head()
        end = self._read_end
        if end == 0:
            end = self._read_end = self._tail()
        if end >= head:
            return None
        capacity = self.capacity
        at = end % capacity
        data = self._data
        if capacity - at < 4 or _LENGTH.unpack_from(data, at)[0] == WRAP:
            end += capacity - at
            at = 0
        size = _LENGTH.unpack_from(data, at)[0]
        self._read_end = end + _aligned(4 + size)
        return data[at + 4 : at + 4 + size]

    def release(self) -> None:
        """Give back the room of every message read so far (their views must be done with)."""
        if self._read_end:
            _COUNTER.pack_into(self._buf, 8, self._read_end)
