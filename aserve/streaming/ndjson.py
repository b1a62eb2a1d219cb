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

from aserve.logs import REQUEST_ID_HEADER, REQUEST_ID_KEY

MEDIA_TYPE = "application/x-ndjson"
HEADERS = {
    "Content-Type": MEDIA_TYPE,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}


def line(doc: Any) -> bytes:
    """``doc`` as one NDJSON line (orjson never writes a raw newline inside a document)."""
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)


class NdjsonResponse:
    """An ``application/x-ndjson`` response, written line by line."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        headers = HEADERS
        rid = request.get(REQUEST_ID_KEY)
        if rid is not None:
            headers = {**HEADERS, REQUEST_ID_HEADER: rid}
        self.response = web.StreamResponse(status=200, headers=headers)
        self.started = False

    async def start(self) -> None:
        """Send the status and headers: from here on the status is 200."""
        self.response.enable_chunked_encoding()
        await self.response.prepare(self._request)
        self.started = True

    async def send(self, doc: Any) -> None:
        await self.response.write(line(doc))

    async def finish(self) -> web.StreamResponse:
        """End the body."""
        await self.response.write_eof()
        return self.response

    async def fail(self, error_doc: Any) -> web.StreamResponse:
        """A failure after the stream started: one error line, then the end."""
        await self.response.write(line(error_doc))
        return await self.finish()
