"""Forwarding a request to the core (frontends layer; in a frontend process, on its loop).

:class:`CoreProxy` sends each request it is handed to the core's app over the
private Unix socket (a pool of kept-alive connections): its method, path and
query as the client sent them, its headers less the hop-by-hop ones (and any
copies of this server's own, :mod:`.wire`), the arrival stamp and the
client's address, and its body as it arrives. The answer comes back the same
way: a short one whole, any other (a server-sent event stream, NDJSON, a
large tensor) chunk by chunk, each chunk written to the client as it comes.

A client that goes away cancels the handler (aiohttp's
``handler_cancellation``); leaving the upstream request half read closes its
connection to the core, which cancels the request there, as for any client
gone. A core that cannot be reached is answered 503; one that breaks off an
answer already begun breaks off the client's connection too.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from aserve.errors import Unavailable
from aserve.frontends.http.kit import ARRIVAL_KEY, error_response
from aserve.frontends.proc.wire import ARRIVAL_HEADER, FORWARDED_FOR_HEADER, HOP_BY_HOP, OWN

log = logging.getLogger("aserve.http.frontend")

# An answer up to this long is read whole and sent as one response; a longer one,
# or one of no declared length (a stream), is passed on chunk by chunk.
WHOLE_UP_TO_BYTES = 256 * 1024
# Kept-alive connections to the core close after this idle time (aiohttp's default),
# or half the core's own http.keepalive_timeout_s when that is shorter: so that the
# core never closes a connection the pool is about to reuse.
POOL_IDLE_S = 15.0
_SKIPPED = HOP_BY_HOP | OWN | {"content-length"}
# On a request: its answer has begun (a failure from then on cannot be answered).
_STARTED_KEY = web.RequestKey("aserve_proxy_started", bool)


class CoreProxy:
    """Forwards requests to the core's app on ``core_socket`` (start, then serve)."""

    def __init__(self, core_socket: str, core_keepalive_s: float) -> None:
        self._core_socket = core_socket
        self._idle_s = min(POOL_IDLE_S, core_keepalive_s / 2)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.UnixConnector(
            path=self._core_socket, limit=0, keepalive_timeout=self._idle_s
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # the bytes as the core sent them, encoding and all
            timeout=aiohttp.ClientTimeout(total=None),  # the core's deadlines rule
            # The client's headers only: none of the client library's own.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request, read: bytes | None = None) -> web.StreamResponse:
        """``request`` answered by the core (a route handler for every path); ``read``:
        its body, when the caller has read it already."""
        assert self._session is not None
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | OWN
        )
        headers[ARRIVAL_HEADER] = repr(request[ARRIVAL_KEY])
        if request.remote:
            headers[FORWARDED_FOR_HEADER] = request.remote
        body: bytes | aiohttp.StreamReader | None = read
        if read is None and request.body_exists:
            content = request.content
            # All of it arrived with the head (most requests): one write; else as it comes.
            body = await content.read() if content.is_eof() else content
        url = URL("http://core" + request.raw_path, encoded=True)
        try:
            async with self._session.request(
                request.method, url, headers=headers, data=body, allow_redirects=False
            ) as upstream:
                return await self._answer(request, upstream)
        except aiohttp.ClientError as exc:
            if request.get(_STARTED_KEY):
                raise  # the answer has begun: aiohttp breaks the connection off
            log.warning("the core did not answer %s %s: %s", request.method, request.path, exc)
            return error_response(Unavailable(f"the server's core did not answer: {exc}"))

    async def _answer(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        headers = CIMultiDict(
            (k, v) for k, v in upstream.headers.items() if k.lower() not in _SKIPPED
        )
        closes = upstream.headers.get("Connection", "").lower() == "close"
        length = upstream.content_length
        if length is not None and length <= WHOLE_UP_TO_BYTES:
            payload = await upstream.read()
            response = web.Response(
                status=upstream.status, reason=upstream.reason, body=payload, headers=headers
            )
            if closes:  # the core closed it (a body that timed out): the client's goes too
                response.force_close()
            return response
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=headers
        )
        if length is not None:
            response.content_length = length
        if closes:
            response.force_close()
        request[_STARTED_KEY] = True
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
