"""Triton's generate extension on a decoupled model (frontends layer; runs on the loop).

``POST /v2/models/{m}/generate_stream`` sends a server-sent event per response
the model yields (NDJSON with ``Accept: application/x-ndjson``), and simply
ends; ``.../generate`` answers the one response of a model that yields
exactly one. The request's top-level keys name the model's inputs
(:mod:`aserve.codecs.generate_tensors`); each event is ``{"id"?,
"model_name", "model_version", <output>: value, ...}``. Errors before the
first event are ordinary ``{"error": "..."}`` answers; after it, a last
``data: {"error": "..."}`` event. A client that goes closes the model's
generator at its next ``yield``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve.codecs.generate_tensors import generate_inputs, generate_outputs
from aserve.codecs.validate import request_timeout
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline
from aserve.frontends.http.kit import ARRIVAL_KEY, RUNTIME_KEY, error_response
from aserve.frontends.http.stream import send_all
from aserve.loop.runtimes.base import Decoupled

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from aserve.frontends.context import FrontendContext
    from aserve.loop.runtimes.decoupled import ResponseStream


class GenerateResponses:
    """The generate routes' path for a :class:`Decoupled` runtime."""

    def __init__(
        self,
        ctx: FrontendContext,
        read_json: Callable[[web.Request, int | None], Awaitable[dict[str, Any]]],
    ) -> None:
        self._ctx = ctx
        self._read_json = read_json
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    async def _start(self, request: web.Request) -> tuple[ResponseStream, dict[str, Any]]:
        """Everything that can fail before the first byte: parse, validate, admit."""
        info = request.match_info
        doc = await self._read_json(request, None)
        # Routing is looked up again after the read, the last await before queueing.
        runtime = self._ctx.registry.get(info["model"], info.get("version") or None)
        if not isinstance(runtime, Decoupled):
            raise InvalidArgument(f"model '{runtime.label}' changed while its request was read")
        request[RUNTIME_KEY] = runtime
        client_id = doc.get("id")
        if client_id is not None and not isinstance(client_id, str):
            raise InvalidArgument("field 'id' must be a string")
        inputs, params = generate_inputs(
            doc, runtime.input_specs, runtime.name, runtime.max_batch_size,
            self._ctx.config.limits.max_tensor_elements,
        )  # fmt: skip
        timeout = resolve_deadline(
            request.headers.get(TIMEOUT_HEADER),
            request_timeout(params),
            None,
            runtime.default_timeout_s,
            self._max_timeout_s,
        )
        stream = runtime.stream(inputs, 1, timeout, client_id, params, arrival=request[ARRIVAL_KEY])
        head = {"model_name": runtime.name, "model_version": runtime.version}
        if client_id is not None:
            head = {"id": client_id, **head}
        return stream, head

    async def generate(self, request: web.Request) -> web.Response:
        try:
            stream, head = await self._start(request)
            async with stream:
                responses = [outputs async for outputs in stream]
            if len(responses) != 1:
                raise InvalidArgument(
                    f"model '{head['model_name']}' answered with {len(responses)} responses; "
                    "generate sends exactly one: use generate_stream"
                )
        except AserveError as exc:
            return error_response(exc)
        doc = {**head, **generate_outputs(responses[0])}
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        try:
            stream, head = await self._start(request)
        except AserveError as exc:
            return error_response(exc)

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for outputs in stream:
                yield {**head, **generate_outputs(outputs)}

        async with stream:  # leaving it (the end, an error, the client gone) closes the generator
            return await send_all(request, events(), lambda exc: {"error": exc.message})
