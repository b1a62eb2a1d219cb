"""The public listening sockets and the private folder of ``http.workers`` (the core's side,
frontends layer; called on the loop before any model loads, no I/O beyond the bind).

The core binds the configured address itself, as its own HTTP frontend would
(``SO_REUSEADDR``, IPv6 sockets IPv6 only, the same backlog), so that an
address in use, ``port: 0`` and the ``aserve ps`` entry read as they do with
no frontends; the sockets are then handed to every frontend process, which
accept on them. The core never accepts on them itself.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

# aiohttp's TCPSite's default, which the core's own listener has.
BACKLOG = 128


def bind_public(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to, on ``port`` (0: a free
    one, picked by the first bind and reused by the others); an :class:`OSError` names
    what failed, and no socket is left open then."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    bound: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(bound) > 1:  # one port for every address
                address = (address[0], bound[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in bound:
            sock.close()
        raise
    return bound


def private_dir() -> Path:
    """A new folder only this user may enter (mode 0700), for the core's Unix socket."""
    return Path(tempfile.mkdtemp(prefix="aserve-http-"))


def remove_private_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
