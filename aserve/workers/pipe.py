"""The server's end of a child process's pipe, on the event loop (layer: ``workers``).

The child reads and writes its end as a plain, blocking
:class:`multiprocessing.connection.Connection`. The server must not: watching
the fd makes the loop set it non-blocking (libuv does), and
``Connection.recv_bytes`` on a non-blocking fd fails with ``EAGAIN`` as soon
as a message arrives in two writes (the child writes the header and the
body of a message over 16 KiB separately), which looked like a dead child.
So the server's end is an asyncio transport: writes are buffered by the
loop, and reads are reassembled here from Connection's framing (a 4-byte
big-endian length, or -1 and an 8-byte length for messages over 2 GiB).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


class PipeChannel(asyncio.Protocol):
    """Length-prefixed messages to and from one child, without blocking the loop.

    ``on_message(payload)`` is called on the loop for each whole message, in
    order; ``on_closed()`` once, when the child's end is closed (it exited).
    """

    def __init__(self, on_message: Callable[[bytes], None], on_closed: Callable[[], None]) -> None:
        self.on_message = on_message  # its owner may hand the stream on (see Supervisor)
        self._on_closed = on_closed
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self._lost = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= 4:
            (size,) = _SHORT.unpack_from(buf)
            start = 4
            if size == -1:
                if len(buf) < 12:
                    return
                (size,) = _LONG.unpack_from(buf, 4)
                start = 12
            end = start + size
            if len(buf) < end:
                return
            payload = bytes(buf[start:end])
            del buf[:end]
            self.on_message(payload)
            if self.closed:
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost.set()
        if not self.closed:
            self.closed = True
            self._on_closed()

    def send(self, payload: bytes) -> None:
        """Queue one message for the child; raises ``OSError`` once the pipe is closed."""
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise BrokenPipeError("the pipe to the child process is closed")
        size = len(payload)
        header = _SHORT.pack(size) if size <= 0x7FFFFFFF else _SHORT.pack(-1) + _LONG.pack(size)
        transport.writelines((header, payload))

    async def wait_closed(self) -> None:
        """Until the child's end is closed and everything it wrote has been read."""
        await self._lost.wait()

    def close(self) -> None:
        """Stop reading and close the server's end (``on_closed`` is not called)."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    async def connect(self, conn: Connection) -> None:
        """Take over ``conn`` (the server's end of a ``Pipe(duplex=True)``: a socket) on the loop.

        ``conn`` is closed; the channel owns a duplicate of its socket. Messages
        may reach ``on_message`` before this returns: uvloop reads what the child
        wrote already in the same loop iteration as ``connection_made``, before
        the awaiting coroutine resumes. A caller that must know the channel when
        its first message comes holds it before connecting (see Supervisor).
        """
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: self, sock)


async def open_channel(
    conn: Connection, on_message: Callable[[bytes], None], on_closed: Callable[[], None]
) -> PipeChannel:
    """A :class:`PipeChannel` that has taken over ``conn`` (see :meth:`PipeChannel.connect`)."""
    channel = PipeChannel(on_message, on_closed)
    await channel.connect(conn)
    return channel
