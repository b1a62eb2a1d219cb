"""A chunked HTTP response of JSON messages, one framing per subclass.

:class:`aserve.streaming.sse.SseResponse` and
:class:`aserve.streaming.ndjson.NdjsonResponse` differ only in how a message
is framed, the headers and what ends a finished stream; the rules are these:
every check that can fail runs before :meth:`FramedStream.start`, from which on
the status is 200; after it a failure is one last framed ``{"error": ...}``
message and the end (:meth:`FramedStream.fail`). Writes wait for the socket,
so a slow client pauses its sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from aserve.logs import REQUEST_ID_HEADER, REQUEST_ID_KEY


class FramedStream:
    """A response written message by message, each ``frame(doc)``; ``sentinel`` (if
    any) is written by :meth:`finish`, not by :meth:`fail`."""

    def __init__(
        self,
        request: web.Request,
        headers: Mapping[str, str],
        frame: Callable[[Any], bytes],
        sentinel: bytes = b"",
    ) -> None:
        self._request = request
        self._frame = frame
        self._sentinel = sentinel
        rid = request.get(REQUEST_ID_KEY)
        if rid is not None:
            headers = {**headers, REQUEST_ID_HEADER: rid}
        self.response = web.StreamResponse(status=200, headers=headers)
        self.started = False

    async def start(self) -> None:
        """Send the status and headers: from here on the status is 200."""
        self.response.enable_chunked_encoding()
        await self.response.prepare(self._request)
        self.started = True

    async def send(self, doc: Any) -> None:
        await self.response.write(self._frame(doc))

    async def finish(self) -> web.StreamResponse:
        """Write the sentinel, if any, and end the body."""
        return await self._end(self._sentinel)

    async def fail(self, error_doc: Any) -> web.StreamResponse:
        """A failure after the stream started: one error message, then the end."""
        return await self._end(self._frame(error_doc))

    async def _end(self, last: bytes) -> web.StreamResponse:
        if last:
            await self.response.write(last)
        await self.response.write_eof()
        return self.response
