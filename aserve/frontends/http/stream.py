"""HTTP token streams: server-sent events or newline-delimited JSON (frontends layer, on the loop).

The framing a stream uses is chosen here alone, from the Accept header:
server-sent events unless the client asks for NDJSON
(``Accept: application/x-ndjson``, ranked above ``text/event-stream`` when both
are listed); :func:`json_stream` makes the response.

- SSE: every message is ``data: <one-line JSON>\\n\\n``. OpenAI streams end with
  ``data: [DONE]`` (:data:`DONE`); Triton's ``generate_stream`` just ends.
- NDJSON: one JSON object per line (``{...}\\n``), as GRPS-style clients read
  it, no ``data:`` framing and no sentinel: the end of the body ends the stream.

The rules are the same for both: every check that can fail runs before
:meth:`JsonStream.start`, from which on the status is 200; after it a failure
is one last framed ``{"error": ...}`` message and the end
(:meth:`JsonStream.fail`). The response is finished (``write_eof``) right
after the last message, never held open: the OpenAI SDK 1.x reads until EOF
after ``[DONE]``. Writes wait for the socket (aiohttp drains its buffer), so a
slow client stops the handler from reading its token channel, which pauses
its sequence (see :mod:`aserve.loop.channel`). A client that has gone
shows up as the handler's cancellation (or as ``ConnectionError`` from a
write), and leaving the handler cancels the generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final

import orjson
from aiohttp import web

from aserve.errors import AserveError, ErrorCode
from aserve.frontends.http.kit import REQUEST_ID_KEY, STATUS_KEY
from aserve.obs.logs import REQUEST_ID_HEADER

DONE: Final = b"data: [DONE]\n\n"
NDJSON: Final = "application/x-ndjson"
_SSE = "text/event-stream"
SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies (nginx) must not buffer the stream
}
NDJSON_HEADERS: Final = {
    "Content-Type": NDJSON,
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def event(doc: Any) -> bytes:
    """One SSE event carrying ``doc`` as JSON."""
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def line(doc: Any) -> bytes:
    """``doc`` as one NDJSON line (orjson never writes a raw newline inside a document)."""
    return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)


class JsonStream:
    """A chunked response written message by message, each ``frame(doc)``;
    ``sentinel`` (if any) is written by :meth:`finish`, not by :meth:`fail`."""

    __slots__ = ("_frame", "_request", "_sentinel", "response", "started")

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


def json_stream(request: web.Request, sse_sentinel: bytes = b"") -> JsonStream:
    """The stream ``request`` asked for; ``sse_sentinel`` ends an SSE stream (OpenAI's
    ``data: [DONE]``), an NDJSON stream just ends."""
    accept = request.headers.get("Accept")
    # The common case costs one substring test, and no call.
    if accept and NDJSON in accept and wants_ndjson(accept):
        return JsonStream(request, NDJSON_HEADERS, line)
    return JsonStream(request, SSE_HEADERS, event, sse_sentinel)


async def send_all(
    request: web.Request,
    docs: AsyncIterator[Any],
    error_doc: Callable[[AserveError], Any],
    sse_sentinel: bytes = b"",
) -> web.StreamResponse:
    """Stream every message of ``docs`` (:func:`json_stream`'s framing), then end.

    An :class:`AserveError` from ``docs`` ends the stream with ``error_doc(exc)``
    and its code in ``request[STATUS_KEY]`` (the status was 200 already); a
    client that went away (``ConnectionError`` from a write) ends it with the
    code ``cancelled``. The caller's ``async with`` around this cancels its
    generation either way.
    """
    stream = json_stream(request, sse_sentinel)
    try:
        await stream.start()
        async for doc in docs:
            await stream.send(doc)
        return await stream.finish()
    except AserveError as exc:
        request[STATUS_KEY] = exc.code.value
        return await stream.fail(error_doc(exc))
    except ConnectionError:
        request[STATUS_KEY] = ErrorCode.CANCELLED.value
        return stream.response
    finally:
        # Closed here, not when collected: what it holds (readers of several
        # choices) ends before the caller's generation is cancelled.
        close = getattr(docs, "aclose", None)
        if close is not None:
            await close()


def wants_ndjson(accept: str | None) -> bool:
    """Whether an Accept header prefers NDJSON to SSE (by q, then by order)."""
    if not accept or NDJSON not in accept:
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
