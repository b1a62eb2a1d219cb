"""Closing the HTTP frontend without losing a request (frontends layer, on the loop).

aiohttp's own shutdown closes every connection at once: a keep-alive client
that has just sent its next request, or is about to, sees a reset or a
closed connection although the server would have answered. The drain here
(:class:`HttpFrontend` calls it after ``drain_grace_s``) keeps HTTP/1.1's
rules instead:

- :func:`take_queued` accepts the connections the kernel already completed
  (in the listen backlog) right before the listening socket closes: their
  clients may have sent a request, and closing the listener would reset them.
- From then on every response carries ``Connection: close`` (the frontend's
  response hook), so a client learns with its answer not to send another
  request on that connection, and aiohttp closes it after the response.
- A connection with no request in progress is closed only once it has been
  idle, with no byte of a new request received, for :data:`IDLE_CLOSE_S`
  (:class:`IdleCloser`): a client using the connection sends its next request
  long before, and that request is answered (with ``Connection: close``).
  A client that stays idle longer and sends exactly as the server closes
  meets the race every keep-alive timeout has (RFC 9112, section 9.3.1).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import socket
import termios
from typing import Any

from aiohttp.web_protocol import RequestHandler

# How long a connection must stay idle during a drain before it is closed.
IDLE_CLOSE_S = 1.0


def take_queued(listener: Any) -> list[socket.socket]:
    """Accept every connection waiting in ``listener``'s backlog, without blocking.

    ``listener`` is one of an asyncio server's sockets (uvloop's too). Call it
    right before the listener closes, with no await in between.
    """
    taken: list[socket.socket] = []
    dup = socket.socket(fileno=os.dup(listener.fileno()))
    try:
        dup.setblocking(False)
        while True:
            try:
                conn, _ = dup.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # out of descriptors: those left are reset with the listener
                break
            conn.setblocking(False)
            taken.append(conn)
    finally:
        dup.close()
    return taken


def unread_bytes(handler: RequestHandler) -> int:
    """Bytes received on the connection that aiohttp has not read yet (FIONREAD)."""
    transport = handler.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None:
        return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except OSError:
        return 0
    return buf[0]


def is_idle(handler: RequestHandler) -> bool:
    """No request in progress or queued on the connection, and no bytes of a new one
    received. The first half is aiohttp's own test before it closes an idle
    keep-alive connection (``RequestHandler._process_keepalive``): its request
    loop waits for the next message."""
    waiter = handler._waiter
    return waiter is not None and not waiter.done() and unread_bytes(handler) == 0


class IdleCloser:
    """Closes the connections seen idle for :data:`IDLE_CLOSE_S` without a break."""

    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self._idle_close_s = idle_close_s
        self._idle_since: dict[RequestHandler, float] = {}

    def sweep(self, connections: list[RequestHandler], now: float) -> None:
        seen: dict[RequestHandler, float] = {}
        for handler in connections:
            if not is_idle(handler):
                continue
            since = self._idle_since.get(handler, now)
            if now - since >= self._idle_close_s:
                handler.force_close()  # nothing unread: a FIN, not a reset
            else:
                seen[handler] = since
        self._idle_since = seen


DRAIN_POLL_S = 0.05  # how often a drain looks for idle connections to close


async def wait_connections_closed(server: Any, timeout_s: float) -> bool:
    """Close the connections of ``server`` (an aiohttp ``web.Server``, whose
    ``connections`` is a new list at each read) as each goes idle, until none is
    left (True) or ``timeout_s`` passed first (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    closer = IdleCloser()
    while connections := server.connections:
        now = loop.time()
        if now >= deadline:
            return False
        closer.sweep(connections, now)
        await asyncio.sleep(DRAIN_POLL_S)
    return True
