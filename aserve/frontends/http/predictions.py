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
grows past it (chunked, or inflated from gzip/deflate); the bodies being
read or served at once, all routes together, are bounded by
``limits.max_inflight_bytes`` (429 past it). A multipart body is split once
it is whole (no part waits on the network), on a thread, within the bounds
of :mod:`aserve.frontends.http.multipart` (parts, header lines, preamble).

Errors answer ``{"error": "..."}`` with the status of docs/errors.md's table: a
model that is not a python handler with ``preprocess_raw`` is a 400 naming
the route it takes instead. The request's timeout is the
``aserve-timeout-ms`` header's, else the model's default
(:func:`aserve.frontends.common.resolve_deadline`).

Frontends layer: the handler runs on the loop, the multipart split on a thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import hdrs, web

from aserve.engines.python_handler import Part
from aserve.errors import AserveError, InvalidArgument, TooLarge
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline
from aserve.frontends.http.bodies import SpooledBody, read_back
from aserve.frontends.http.kit import ARRIVAL_KEY, RUNTIME_KEY, RouteKit, error_response
from aserve.frontends.http.multipart import split_parts
from aserve.loop.runtimes.handler import HandlerRuntime
from aserve.types.text import utf8_safe

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.loop.runtimes.base import Runtime

_DEFAULT_TYPE = "application/octet-stream"


def add_prediction_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    predictions = Predictions(kit, ctx)
    for path in ("/predictions/{model}", "/predictions/{model}/{version}"):
        kit.route("POST", path, kit.counted("http", predictions.predict, error_response))


class Predictions:
    def __init__(self, kit: RouteKit, ctx: FrontendContext) -> None:
        self._ctx = ctx
        self._read_body = kit.read_body_spooled
        self._max_body = ctx.config.limits.max_request_bytes
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    def _runtime(self, request: web.Request) -> HandlerRuntime:
        info = request.match_info
        runtime: Runtime = self._ctx.registry.get(info["model"], info.get("version"))
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
        body: bytes | list[Part]
        if request.content_type == "multipart/form-data":
            # On a thread: each part's data read (or copied) into its own bytes, and
            # the whole body dropped, so the request holds its bytes about once.
            body = await asyncio.to_thread(_split, content_type, raw)
        elif isinstance(raw, SpooledBody):
            body = await asyncio.to_thread(read_back, raw)
        else:
            body = raw
        del raw
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
        answer, answer_type = await runtime.infer_raw(
            body, content_type, timeout, None, query, arrival=request[ARRIVAL_KEY]
        )
        return web.Response(body=answer, headers={hdrs.CONTENT_TYPE: answer_type})


def _split(content_type: str, raw: bytes | SpooledBody) -> list[Part]:
    """On a thread: the parts; a spooled body is closed (and so gone) after."""
    if isinstance(raw, bytes):
        return split_parts(content_type, raw)
    with raw:
        return split_parts(content_type, raw)
