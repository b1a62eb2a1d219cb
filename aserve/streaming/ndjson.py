"""Newline-delimited JSON over aiohttp: the sibling of :mod:`aserve.streaming.sse`.

Every message is one JSON object on a line of its own (``{...}\\n``), in a
chunked ``application/x-ndjson`` body, as GRPS-style clients read it: no
``data:`` framing and no sentinel; the end of the body is the end of the
stream. The interface and its rules are :class:`aserve.streaming.sse.SseResponse`'s:
every check that can fail runs before :meth:`NdjsonResponse.start`; after
it, a failure is one last line ``{"error": ...}`` (see :meth:`NdjsonResponse.fail`)
and the end. Writes wait for the socket, so a slow client pauses its sequence.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aserve.streaming.framed import FramedStream

MEDIA_TYPE = "application/x-ndjson"
HEADERS = {
    "Content-Type": MEDIA_TYPE,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}


def line(doc: Any) -> bytes:
    """``doc`` as one NDJSON line (orjson never writes a raw newline inside a document)."""
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)


class NdjsonResponse(FramedStream):
    """An ``application/x-ndjson`` response, written line by line (no sentinel)."""

    def __init__(self, request: web.Request) -> None:
        super().__init__(request, HEADERS, line)
