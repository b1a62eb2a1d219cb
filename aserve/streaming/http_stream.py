"""Which framing an HTTP token stream uses: the one place that reads the Accept header.

Server-sent events unless the client asks for newline-delimited JSON
(``Accept: application/x-ndjson``, ranked above ``text/event-stream`` when both
are listed). Both framings have the :class:`JsonStream` interface.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from aserve.streaming.ndjson import MEDIA_TYPE as NDJSON
from aserve.streaming.ndjson import NdjsonResponse
from aserve.streaming.sse import SseResponse

_SSE = "text/event-stream"


class JsonStream(Protocol):
    response: web.StreamResponse
    started: bool

    async def start(self) -> None: ...
    async def send(self, doc: Any) -> None: ...
    async def finish(self) -> web.StreamResponse: ...
    async def fail(self, error_doc: Any) -> web.StreamResponse: ...


def json_stream(request: web.Request, sse_sentinel: bytes = b"") -> JsonStream:
    """The stream ``request`` asked for; ``sse_sentinel`` ends an SSE stream (OpenAI's
    ``data: [DONE]``), an NDJSON stream just ends."""
    if wants_ndjson(request.headers.get("Accept")):
        return NdjsonResponse(request)
    return SseResponse(request, sse_sentinel)


def wants_ndjson(accept: str | None) -> bool:
    """Whether an Accept header prefers NDJSON to SSE (by q, then by order)."""
    if not accept or NDJSON not in accept:  # the common case costs one substring test
        return False
    ranks: dict[str, tuple[float, int]] = {}
    for index, item in enumerate(accept.split(",")):
        media, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        ranks.setdefault(media.lower(), (q, -index))
    ndjson = ranks.get(NDJSON, (0.0, 0))
    return ndjson[0] > 0 and ndjson > ranks.get(_SSE, (0.0, 0))
