"""Triton's generate extension over HTTP.

``POST /v2/models/{m}[/versions/{v}]/generate`` answers one JSON object;
``.../generate_stream`` answers server-sent events, one per piece of text,
and simply ends (no ``[DONE]``); with ``Accept: application/x-ndjson``, the
same objects as newline-delimited JSON (:mod:`aserve.frontends.http.stream`). The request is
``{"id"?, "text_input": str, "parameters"?: {...}}``; other top-level keys
count as parameters, as Triton maps them. Parameters: ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``,
``timeout_ms`` / ``timeout`` (µs), ``exclude_input_in_output`` (default
true: ``text_output`` holds only the generated text; false puts the prompt
in front), ``priority`` (vLLM's, as on the OpenAI routes: an integer, lower
admitted first, 0 by default). The answer: ``{"id"?, "model_name", "model_version",
"text_output"}``, and on the last one ``finish_reason`` and ``usage``.

Errors before the stream starts are ordinary ``{"error": "..."}`` answers
with the status of :data:`aserve.frontends.status.HTTP_STATUS`; after it
starts, ``data: {"error": "..."}`` (NDJSON: a last line ``{"error": "..."}``)
and the end of the stream. A decoupled model takes its inputs as top-level
keys and answers its outputs (:mod:`aserve.frontends.http.generate_responses`).
(Frontends layer; handlers run on the loop.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve.codecs.sampling import sampling_from_parameters
from aserve.codecs.validate import request_timeout
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline, usage
from aserve.frontends.http.generate_responses import GenerateResponses
from aserve.frontends.http.kit import (
    ARRIVAL_KEY,
    RUNTIME_KEY,
    RouteKit,
    error_response,
)
from aserve.frontends.http.stream import send_all
from aserve.loop.prompt_size import body_limit
from aserve.loop.runtimes.base import Decoupled
from aserve.loop.runtimes.generation import generation_runtime, parameter_priority

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext


# --- Triton's generate extension ------------------------------------------------

_OWN_KEYS = ("id", "text_input", "parameters")


class TritonGenerate:
    def __init__(self, kit: RouteKit, ctx: FrontendContext) -> None:
        self._ctx = ctx
        self._read_json = kit.read_json
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3
        self._responses = GenerateResponses(ctx, kit.read_json)

    def _decoupled(self, request: web.Request) -> bool:
        """Whether the request names a decoupled model (an unknown one is the
        decoder path's to refuse)."""
        info = request.match_info
        try:
            runtime = self._ctx.registry.get(info["model"], info.get("version") or None)
        except AserveError:
            return False
        return isinstance(runtime, Decoupled)

    def add_routes(self, kit: RouteKit) -> None:
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            generate = kit.counted("http", self.generate, error_response)
            kit.route("POST", base + "/generate", generate)
            stream = kit.counted("http", self.generate_stream, error_response)
            kit.route("POST", base + "/generate_stream", stream)

    async def _start(self, request: web.Request) -> tuple[Any, ...]:
        """Everything that can fail before the first byte: parse, validate, admit."""
        info = request.match_info
        registry = self._ctx.registry
        # The model first: an unknown one is refused without reading the body,
        # and its limits bound what is read and parsed.
        runtime = generation_runtime(registry, info["model"], info.get("version"))
        doc = await self._read_json(request, body_limit(runtime.generation))
        # Routing is looked up again after the last await before queueing (but
        # for a long prompt's tokenizing, which the runtime counts as busy): a
        # runtime that a reload takes out of routing is drained and unloaded once idle.
        runtime = generation_runtime(registry, info["model"], info.get("version"))
        request[RUNTIME_KEY] = runtime
        client_id = doc.get("id")
        if client_id is not None and not isinstance(client_id, str):
            raise InvalidArgument("field 'id' must be a string")
        prompt = doc.get("text_input")
        if not isinstance(prompt, str):
            raise InvalidArgument("field 'text_input' must be a string")
        params = doc.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("field 'parameters' must be an object")
        params = {**{k: v for k, v in doc.items() if k not in _OWN_KEYS}, **params}
        exclude = params.get("exclude_input_in_output", True)
        if not isinstance(exclude, bool):
            raise InvalidArgument("parameter 'exclude_input_in_output' must be true or false")
        # Header and parameters are both checked: a bad one is refused even
        # when the other asks for less time.
        timeout = resolve_deadline(
            request.headers.get(TIMEOUT_HEADER),
            request_timeout(params),
            None,
            runtime.default_timeout_s,
            self._max_timeout_s,
        )
        sampling = sampling_from_parameters(params)
        priority = parameter_priority(params)
        seq = await runtime.prepare(sampling, prompt=prompt, client_id=client_id, priority=priority)
        req = runtime.generate(
            seq, timeout, client_id, arrival=request[ARRIVAL_KEY], priority=priority
        )
        head = {"model_name": runtime.name, "model_version": runtime.version}
        if client_id is not None:
            head = {"id": client_id, **head}
        return req, head, ("" if exclude else prompt)

    async def generate(self, request: web.Request) -> web.Response:
        if self._decoupled(request):
            return await self._responses.generate(request)
        try:
            req, head, prefix = await self._start(request)
            async with req:
                text, last = await req.collect()
        except AserveError as exc:
            return error_response(exc)
        doc = {
            **head,
            "text_output": prefix + text,
            "finish_reason": last.finish_reason if last else None,
            "usage": usage(last),
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        if self._decoupled(request):
            return await self._responses.generate_stream(request)
        try:
            req, head, prefix = await self._start(request)
        except AserveError as exc:
            return error_response(exc)

        async def events() -> AsyncIterator[dict[str, Any]]:
            text_prefix = prefix
            async for delta in req:
                if not (delta.text or text_prefix or delta.finished):
                    continue
                doc = {**head, "text_output": text_prefix + delta.text}
                text_prefix = ""
                if delta.finished:
                    doc["finish_reason"] = delta.finish_reason
                    doc["usage"] = usage(delta)
                yield doc

        async with req:  # leaving it (the end, an error, the client gone) cancels the sequence
            return await send_all(request, events(), _error)


def _error(exc: AserveError) -> dict[str, str]:
    return {"error": exc.message}


def add_generate_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    """Register Triton's generate extension."""
    TritonGenerate(kit, ctx).add_routes(kit)
