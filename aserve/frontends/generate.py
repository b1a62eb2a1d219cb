"""Triton's generate extension over HTTP, and what the HTTP generation routes share.

``POST /v2/models/{m}[/versions/{v}]/generate`` answers one JSON object;
``.../generate_stream`` answers server-sent events, one per piece of text,
and simply ends (no ``[DONE]``); with ``Accept: application/x-ndjson``, the
same objects as newline-delimited JSON (:mod:`aserve.streaming.http_stream`). The request is
``{"id"?, "text_input": str, "parameters"?: {...}}``; other top-level keys
count as parameters, as Triton maps them. Parameters: ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``,
``timeout_ms`` / ``timeout`` (µs), ``exclude_input_in_output`` (default
true: ``text_output`` holds only the generated text; false puts the prompt
in front). The answer: ``{"id"?, "model_name", "model_version",
"text_output"}``, and on the last one ``finish_reason`` and ``usage``.

Errors before the stream starts are ordinary ``{"error": "..."}`` answers
with the status of :data:`aserve.frontends.status.HTTP_STATUS`; after it
starts, ``data: {"error": "..."}`` (NDJSON: a last line ``{"error": "..."}``)
and the end of the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve.codecs.sampling import sampling_from_parameters
from aserve.codecs.validate import request_timeout
from aserve.errors import AserveError, ErrorCode, InvalidArgument, TooLarge
from aserve.frontends.http import MAX_TIMEOUT_KEY, error_response, read_body
from aserve.frontends.http_metrics import RUNTIME_KEY, STATUS_KEY, inference_route
from aserve.loop.deadline import TIMEOUT_HEADER, header_timeout_s, request_timeout_s
from aserve.loop.prompt_size import BODY_BYTES_PER_PROMPT_BYTE, BODY_SLACK_BYTES, body_limit
from aserve.loop.runtimes.generation import GenerationRuntime, generation_runtime
from aserve.streaming.channel import Delta
from aserve.streaming.http_stream import json_stream

if TYPE_CHECKING:
    from aserve.loop.runtime import Server

log = logging.getLogger("aserve.http")

Route = Callable[[str, str, Any], None]


# --- shared by the HTTP generation routes -------------------------------------


async def read_json_object(request: web.Request, limit_bytes: int | None = None) -> dict[str, Any]:
    """The request body as a JSON object, or :class:`InvalidArgument` / :class:`TooLarge`.

    A body over ``limit_bytes`` is refused before it is read (by its
    Content-Length) or parsed: parsing runs on the loop.
    """
    declared = request.content_length
    if limit_bytes is not None and declared is not None and declared > limit_bytes:
        raise _body_too_large(declared, limit_bytes)
    body = await read_body(request)
    if limit_bytes is not None and len(body) > limit_bytes:
        raise _body_too_large(len(body), limit_bytes)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")
    return doc


def timeout_for(
    request: web.Request, runtime: GenerationRuntime, param_timeout_s: float | None = None
) -> float:
    """The generation's timeout by :mod:`aserve.loop.deadline`'s rule: the
    earlier of the header's and the parameters', else the model's default."""
    return request_timeout_s(
        (header_timeout_s(request.headers.get(TIMEOUT_HEADER)), param_timeout_s),
        runtime.default_timeout_s,
        request.app[MAX_TIMEOUT_KEY],
    )


def _body_too_large(size: int, limit: int) -> TooLarge:
    return TooLarge(
        f"request body: {size} bytes, over the limit of a generation request to this model "
        f"({limit} bytes: {BODY_BYTES_PER_PROMPT_BYTE} x generation.max_prompt_bytes "
        f"+ {BODY_SLACK_BYTES // 1024} KiB)"
    )


def usage(delta: Delta | None) -> dict[str, int]:
    prompt = delta.prompt_tokens if delta else 0
    completion = delta.completion_tokens if delta else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# --- Triton's generate extension ------------------------------------------------

_OWN_KEYS = ("id", "text_input", "parameters")


class TritonGenerate:
    def __init__(self, server: Server) -> None:
        self._server = server

    def add_routes(self, route: Route) -> None:
        server = self._server
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            route(
                "POST",
                base + "/generate",
                inference_route(server, "http", self.generate, error_response),
            )
            route(
                "POST",
                base + "/generate_stream",
                inference_route(server, "http", self.generate_stream, error_response),
            )

    async def _start(self, request: web.Request) -> tuple[Any, ...]:
        """Everything that can fail before the first byte: parse, validate, admit."""
        info = request.match_info
        registry = self._server.registry
        # The model first: an unknown one is refused without reading the body,
        # and its limits bound what is read and parsed.
        runtime = generation_runtime(registry, info["model"], info.get("version"))
        doc = await read_json_object(request, body_limit(runtime.generation))
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
        timeout = timeout_for(request, runtime, request_timeout(params))
        sampling = sampling_from_parameters(params)
        seq = await runtime.prepare(sampling, prompt=prompt, client_id=client_id)
        req = runtime.generate(seq, timeout, client_id)
        head = {"model_name": runtime.name, "model_version": runtime.version}
        if client_id is not None:
            head = {"id": client_id, **head}
        return req, head, ("" if exclude else prompt)

    async def generate(self, request: web.Request) -> web.Response:
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
        try:
            req, head, prefix = await self._start(request)
        except AserveError as exc:
            return error_response(exc)
        sse = json_stream(request)
        async with req:
            try:
                await sse.start()
                async for delta in req:
                    if not (delta.text or prefix or delta.finished):
                        continue
                    doc = {**head, "text_output": prefix + delta.text}
                    prefix = ""
                    if delta.finished:
                        doc["finish_reason"] = delta.finish_reason
                        doc["usage"] = usage(delta)
                    await sse.send(doc)
                return await sse.finish()
            except AserveError as exc:
                request[STATUS_KEY] = exc.code.value
                return await sse.fail({"error": exc.message})
            except ConnectionError:
                request[STATUS_KEY] = ErrorCode.CANCELLED.value
                return sse.response  # the client went away; leaving cancels the sequence


def add_generation_routes(route: Route, server: Server) -> None:
    """Register Triton's generate extension and the OpenAI-compatible API."""
    from aserve.frontends.openai import OpenAIApi

    TritonGenerate(server).add_routes(route)
    OpenAIApi(server).add_routes(route)
