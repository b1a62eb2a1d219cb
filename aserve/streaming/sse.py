"""Server-sent events over aiohttp: the framing both HTTP streaming APIs use.

Every event is ``data: <one-line JSON>\\n\\n``. OpenAI streams end with
``data: [DONE]``; Triton's ``generate_stream`` just ends. The response is
finished (``write_eof``) right after the last event, never held open: the
OpenAI SDK 1.x reads until EOF after ``[DONE]``.

Nothing here decides status codes: a handler runs every check that can fail
*before* :meth:`SseResponse.start`; after it, failures travel as an event
(see :meth:`SseResponse.fail`). Writes wait for the socket (aiohttp drains
its buffer), so a slow client stops the handler from reading its token
channel, which is what pauses its sequence (see
:mod:`aserve.streaming.channel`). A client that has gone shows up as the
handler's cancellation (or as ``ConnectionError`` from a write), and leaving
the handler cancels the generation.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aserve.streaming.framed import FramedStream

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}


def event(doc: Any) -> bytes:
    """One SSE event carrying ``doc`` as JSON."""
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class SseResponse(FramedStream):
    """An ``text/event-stream`` response, written event by event.

    ``sentinel`` (e.g. :data:`DONE`) is written by :meth:`finish`, not by :meth:`fail`.
    """

    def __init__(self, request: web.Request, sentinel: bytes = b"") -> None:
        super().__init__(request, HEADERS, event, sentinel)
