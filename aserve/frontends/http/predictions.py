"""``POST /predictions/{model}[/{version}]``: a raw body for a handler model (frontends layer, on the loop).

TorchServe's route: the body goes to the python handler as it came
(``request.body`` bytes and ``request.content_type``; see
:mod:`aserve.engines.python_handler`), through the model's batcher like a V2
request, and the handler's answer is sent back with the content type it
chose. ``multipart/form-data`` (``curl -F a=@cat.jpg -F b=@dog.jpg``) is
one request whose body is the list of its parts; the query string is the
request's ``parameters``.

Bounds, all checked before the handler sees anything: the model is looked up
before the body is read (an unknown one costs no read); a Content-Length over
``limits.max_request_bytes`` is refused before reading, and so is a body that
grows past it (chunked, or inflated from gzip/deflate); a multipart body
has at most :data:`MAX_PARTS` parts, each with at most 16 header lines of
8 KiB, and at most :data:`MAX_PREAMBLE_BYTES` before its first boundary.
The multipart body is parsed from memory once it is whole (no part waits on
the network), by aiohttp's reader on a thread.

Errors answer ``{"error": "..."}`` with the status of the README's table: a
model that is not a python handler with ``preprocess_raw`` is a 400 naming
the route it takes instead. The request's timeout is the
``aserve-timeout-ms`` header's, else the model's default
(:func:`aserve.frontends.common.resolve_deadline`).

Frontends layer: the handler runs on the loop, the multipart parser on a thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import parse_mimetype
from aiohttp.multipart import (
    BodyPartReader,
    MultipartReader,
    content_disposition_filename,
    parse_content_disposition,
)
from aiohttp.streams import StreamReader

from aserve.engines.python_handler import Part
from aserve.errors import AserveError, InvalidArgument, TooLarge
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline
from aserve.frontends.http.kit import RUNTIME_KEY, RouteKit, error_response
from aserve.loop.runtimes.handler import HandlerRuntime
from aserve.types.text import header_bytes, utf8_safe

if TYPE_CHECKING:
    from aserve.context import FrontendContext
    from aserve.loop.runtimes.base import Runtime as ModelRuntime

MAX_PARTS = 128  # parts of one multipart/form-data body
MAX_PREAMBLE_BYTES = 1024  # before the first boundary (RFC 2046 allows some; nobody sends it)
_MAX_PART_HEADERS = 16  # clients send two or three (Content-Disposition, -Type)
_MAX_HEADER_LINE_BYTES = 8190
_READ_CHUNK_BYTES = 256 * 1024
_FEED_BYTES = 16 * 1024
_DEFAULT_TYPE = "application/octet-stream"


def add_prediction_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    predictions = Predictions(kit, ctx)
    for path in ("/predictions/{model}", "/predictions/{model}/{version}"):
        kit.route("POST", path, kit.counted("http", predictions.predict, error_response))


class Predictions:
    def __init__(self, kit: RouteKit, ctx: FrontendContext) -> None:
        self._ctx = ctx
        self._read_body = kit.read_body
        self._max_body = ctx.config.limits.max_request_bytes
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    def _runtime(self, request: web.Request) -> HandlerRuntime:
        info = request.match_info
        runtime: ModelRuntime = self._ctx.registry.get(info["model"], info.get("version"))
        if not isinstance(runtime, HandlerRuntime):
            raise InvalidArgument(
                f"model '{runtime.name}' is served by the {runtime.config.engine} engine; "
                "/predictions hands the raw body to a python handler (engine 'python' with "
                f"preprocess_raw): send tensors to /v2/models/{runtime.name}/infer"
            )
        reason = runtime.raw_refusal()
        if reason is not None:
            raise InvalidArgument(reason)
        return runtime

    async def predict(self, request: web.Request) -> web.Response:
        try:
            return await self._predict(request)
        except AserveError as exc:
            return error_response(exc)

    async def _predict(self, request: web.Request) -> web.Response:
        # The model first: an unknown one, or one that takes no raw body, is refused
        # without reading the body.
        self._runtime(request)
        limit = self._max_body
        declared = request.content_length
        if declared is not None and declared > limit:
            raise TooLarge(
                f"request body is {declared} bytes, over the limit max_request_bytes {limit}"
            )
        content_type = utf8_safe(request.headers.get(hdrs.CONTENT_TYPE, _DEFAULT_TYPE))
        raw = await self._read_body(request)
        body: bytes | list[Part] = raw
        if request.content_type == "multipart/form-data":
            body = await read_parts(content_type, raw)
        # Routing is looked up again after the last await before queueing: a
        # runtime a reload takes out of routing is drained once it is idle.
        runtime = self._runtime(request)
        request[RUNTIME_KEY] = runtime
        timeout = resolve_deadline(
            request.headers.get(TIMEOUT_HEADER),
            None,
            None,
            runtime.default_timeout_s,
            self._max_timeout_s,
        )
        query: dict[str, str] = {}
        for k, v in request.query.items():  # a repeated name: its first value, as dict() takes
            query.setdefault(utf8_safe(k), utf8_safe(v))
        answer, answer_type = await runtime.infer_raw(body, content_type, timeout, None, query)
        return web.Response(body=answer, headers={hdrs.CONTENT_TYPE: answer_type})


async def read_parts(content_type: str, body: bytes) -> list[Part]:
    """The parts of a whole ``multipart/form-data`` body; :class:`InvalidArgument`
    when it is malformed, :class:`TooLarge` past :data:`MAX_PARTS`.

    Parsed on a thread, on an event loop of its own: aiohttp's reader is
    Python code that costs about a millisecond per part (its header and
    Content-Disposition parsing) and half a second for 64 MiB of data.
    """
    return await asyncio.to_thread(asyncio.run, _parse(content_type, body))


async def _parse(content_type: str, body: bytes) -> list[Part]:
    """On the thread's own loop."""
    reader = _reader(content_type, body)
    parts: list[Part] = []
    try:
        while True:
            item = await reader.next()
            if item is None:
                break
            if not isinstance(item, BodyPartReader):
                raise InvalidArgument("multipart body: nested multipart parts are not supported")
            chunks = []
            while chunk := await item.read_chunk(_READ_CHUNK_BYTES):
                chunks.append(chunk)
            # Parsed once: aiohttp's name and filename properties parse it each.
            _, params = parse_content_disposition(item.headers.get(hdrs.CONTENT_DISPOSITION))
            name = content_disposition_filename(params, "name")
            filename = content_disposition_filename(params, "filename")
            ctype = item.headers.get(hdrs.CONTENT_TYPE)
            # Header bytes that are not UTF-8 came as lone surrogates: the handler
            # gets them as U+FFFD (text it can echo, log or label a metric with),
            # the filename's bytes as sent apart.
            parts.append(
                Part(
                    None if name is None else utf8_safe(name),
                    None if filename is None else utf8_safe(filename),
                    None if ctype is None else utf8_safe(ctype),
                    b"".join(chunks),
                    None if filename is None else header_bytes(filename),
                )
            )
    except AserveError:
        raise
    except Exception as exc:  # aiohttp's parser: ValueError, AssertionError, BadHttpMessage...
        why = str(getattr(exc, "message", None) or exc).strip() or type(exc).__name__
        if why == "Reading after EOF":
            why = "it ends before its closing boundary"
        raise InvalidArgument(f"multipart body cannot be read: {why}") from None
    if not parts:
        raise InvalidArgument("multipart body has no parts")
    return parts


def _reader(content_type: str, body: bytes) -> MultipartReader:
    """aiohttp's reader over ``body`` in memory, once the cheap bounds hold."""
    try:
        reader = MultipartReader(
            {hdrs.CONTENT_TYPE: content_type},
            _in_memory(body),
            max_field_size=_MAX_HEADER_LINE_BYTES,
            max_headers=_MAX_PART_HEADERS,
        )
    except (ValueError, AssertionError) as exc:
        raise InvalidArgument(f"multipart body cannot be read: {exc}") from None
    boundary = b"--" + parse_mimetype(content_type).parameters["boundary"].strip('"').encode()
    # Counted at C speed before any line is parsed: the parser reads the
    # preamble line by line, and each part costs its headers.
    first = body.find(boundary)
    if first < 0:
        raise InvalidArgument(
            "multipart body cannot be read: no boundary "
            f"{boundary[2:].decode('latin-1')!r} (from its Content-Type) in it"
        )
    if first > MAX_PREAMBLE_BYTES:
        raise InvalidArgument(
            f"multipart body has {first} bytes before its first boundary, over the "
            f"{MAX_PREAMBLE_BYTES} aserve reads"
        )
    if body.count(boundary) - 1 > MAX_PARTS:  # every part's delimiter, and the closing one
        raise TooLarge(f"multipart body has over {MAX_PARTS} parts, the most aserve takes")
    return reader


def _in_memory(body: bytes) -> StreamReader:
    loop = asyncio.get_running_loop()
    # Its limit above the body's size: the whole body fits, so the stream never
    # asks the (absent) transport to pause.
    stream = StreamReader(BaseProtocol(loop), limit=len(body) + 1, loop=loop)
    # Fed in pieces: the reader copies what is left of its current piece at each
    # read, which over one piece of the whole body would cost the body per line.
    view = memoryview(body)
    for start in range(0, len(body), _FEED_BYTES):
        stream.feed_data(bytes(view[start : start + _FEED_BYTES]))
    stream.feed_eof()
    return stream
