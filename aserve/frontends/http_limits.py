"""``limits.max_connections`` for the aiohttp frontend (on the loop).

aiohttp accepts every connection; this module marks the ones that arrive
while ``limit`` are already open, and answers the first request on a marked
connection with 429 (``Retry-After: 1``) and closes it. Answering a request,
rather than closing at once, lets the client read why; closing frees the
slot for a later connection. Nothing is installed when there is no limit, so
the request path is unchanged then.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server


def limit_connections(server: Server, limit: int, rejected: dict[str, int]) -> None:
    """Refuse requests on connections beyond ``limit``; counts them in ``rejected``.

    Call after ``AppRunner.setup()`` and before the site starts: connection
    handlers read ``server.request_handler`` when they are created.
    """
    over: set[RequestHandler] = set()
    connection_made, connection_lost = server.connection_made, server.connection_lost
    handle = server.request_handler

    def made(handler: RequestHandler, transport: asyncio.Transport) -> None:
        connection_made(handler, transport)
        if len(server.connections) > limit:
            over.add(handler)

    def lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
        over.discard(handler)
        connection_lost(handler, exc)

    async def request_handler(request: Any) -> web.StreamResponse:
        if request.protocol not in over:
            return await handle(request)
        rejected["max_connections"] = rejected.get("max_connections", 0) + 1
        open_now = len(server.connections)
        response = web.Response(
            status=429,
            body=orjson.dumps({"error": (
                f"server has {open_now} HTTP connections open, its limit "
                f"limits.max_connections is {limit}; retry later"
            )}),
            content_type="application/json",
            headers={"Retry-After": "1"},
        )  # fmt: skip
        response.force_close()  # the slot goes back once this connection closes
        return response

    server.connection_made = made  # type: ignore[method-assign]
    server.connection_lost = lost  # type: ignore[method-assign]
    server.request_handler = request_handler
