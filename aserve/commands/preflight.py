"""Are the listening addresses free? Asked before the server's heavy imports.

The server binds its listeners before any model loads (``server.py``);
reaching that point still takes the import of torch and the frontends, over a
second. This check binds and releases each configured address with plain
sockets first, so that a port in use ends the process in milliseconds. It
decides nothing else: the real bind that follows reports any race on its own.
"""

from __future__ import annotations

import os
import socket

from aserve.config import ServerConfig


def address_in_use(config: ServerConfig) -> str | None:
    """Why one of the configured listening addresses cannot be bound, or None."""
    wanted = [("HTTP", config.http.host, config.http.port)]
    if config.grpc is not None:
        wanted.append(("gRPC", config.grpc.host, config.grpc.port))
    for label, host, port in wanted:
        if port == 0:
            continue  # a free port is picked at bind time
        reason = _cannot_bind(host, port)
        if reason is not None:
            where = f"[{host}]" if ":" in host else host
            return f"{label} cannot listen on {where}:{port}: {reason}"
    return None


def _cannot_bind(host: str, port: int) -> str | None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return str(exc)
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            # As the listeners do: a port left in TIME_WAIT by a previous run is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as exc:
                return os.strerror(exc.errno) if exc.errno else str(exc)
    return None
