"""OpenAI's ``POST /v1/embeddings``, for models whose config has ``openai.embeddings``.

Each item of ``input`` (a string, a list of token ids, or a list of either)
is one request of batch size 1 to the model's own runtime, so it goes through
the model's batcher, admission and deadline like a ``/infer`` request, and
batches with other clients' items (one request holding its items together
would batch only with requests of its own size). A request has at most
``max_batch_size x instances`` of its items in the model at once (enough to
fill every instance's batch), and at most ``batching.max_queue_size``, so a
request of many items never fills the queue with its own. The first item that fails fails the request (the others
are withdrawn), with that item's error.

The body (:mod:`aserve.frontends.http.embedding_request`) is checked whole
before any item is queued. The answer is OpenAI's ``{"object": "list",
"data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}``;
errors are the OpenAI routes' (:func:`aserve.frontends.http.openai.error_response`).

Frontends layer; the handler runs on the loop (a large body is parsed on a thread).
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from aiohttp import web

from aserve.codecs.v2 import json_object
from aserve.codecs.validate import check_shapes
from aserve.config import EmbeddingsConfig
from aserve.errors import AserveError, NotFound, Unavailable
from aserve.frontends.common import TIMEOUT_HEADER, resolve_deadline
from aserve.frontends.http.embedding_request import (
    EmbeddingRequest,
    answer_vector,
    embedding_config,
    parse_embedding_request,
)
from aserve.frontends.http.kit import ARRIVAL_KEY, JSON, RUNTIME_KEY, RouteKit
from aserve.frontends.http.openai import error_response
from aserve.frontends.http.openai_fields import FieldError
from aserve.types.tensors import numpy_dtype

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.loop.runtimes.base import Runtime

# A body larger than this is parsed and checked on a thread: at the limit
# (limits.max_request_bytes), a list of millions of token ids takes a second.
INLINE_PARSE_BYTES = 256 * 1024


def add_embedding_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    """Register ``POST /v1/embeddings``."""
    api = EmbeddingsApi(kit, ctx)
    kit.route("POST", "/v1/embeddings", kit.counted("openai", api.embeddings, error_response))


class EmbeddingsApi:
    def __init__(self, kit: RouteKit, ctx: FrontendContext) -> None:
        self._ctx = ctx
        self._read_body = kit.read_body
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            raw = await self._read_body(request)  # bounded by limits.max_request_bytes
            large = len(raw) > INLINE_PARSE_BYTES
            body = await asyncio.to_thread(json_object, raw) if large else json_object(raw)
            runtime = self._runtime(body.get("model"))
            args = (body, *_model_terms(runtime))
            if large:
                parsed = await asyncio.to_thread(parse_embedding_request, *args)
                # Routing again, with no await from here to the submit: a reload may have
                # swapped the model while the body was checked.
                again = self._runtime(parsed.model)
                if _model_terms(again) != args[1:]:
                    raise Unavailable(
                        f"model '{again.name}' was reloaded with other embedding settings "
                        "while the request was checked; retry"
                    )
                runtime = again
            else:
                parsed = parse_embedding_request(*args)
            request[RUNTIME_KEY] = runtime
            timeout = resolve_deadline(
                request.headers.get(TIMEOUT_HEADER),
                parsed.timeout_s,
                None,
                runtime.default_timeout_s,
                self._max_timeout_s,
            )
            outputs = await _embed_all(runtime, parsed, timeout, request[ARRIVAL_KEY])
            answer = _answer(parsed, outputs)
        except AserveError as exc:
            return error_response(exc)
        return web.Response(body=answer, content_type=JSON)

    def _runtime(self, model: Any) -> Runtime:
        """The model the body names, if it embeds: NotFound (404), else a 400 naming ``model``."""
        if not isinstance(model, str) or not model:
            raise FieldError("model", "is required (a model name from /v1/models)")
        try:
            runtime = self._ctx.registry.get(model)
        except NotFound:
            raise NotFound(f"The model '{model}' does not exist") from None
        if embedding_config(runtime) is None:
            raise FieldError(
                "model",
                f"model '{runtime.label}' does not embed: its config has no openai.embeddings "
                f"(engine '{runtime.config.engine}')",
            )
        return runtime


def _model_terms(runtime: Runtime) -> tuple[EmbeddingsConfig, str, str, int]:
    """What a body is checked against: the model's embedding settings, its label,
    its input's datatype and its embedding's size (plain values, for a thread)."""
    config = embedding_config(runtime)
    assert config is not None  # EmbeddingsApi._runtime routes only to such models
    spec = runtime.input_specs[config.input]
    size = runtime.output_specs[config.output].shape[0]
    return config, runtime.label, spec.datatype, size


async def _embed_all(
    runtime: Runtime, parsed: EmbeddingRequest, timeout_s: float, arrival: float
) -> list[dict[str, np.ndarray]]:
    """Every item through ``runtime.infer``, at most a window of them at once; their
    outputs in order. The first failure is raised; the other items are withdrawn."""
    config = embedding_config(runtime)
    assert config is not None
    spec = runtime.input_specs[config.input]
    dtype = numpy_dtype(spec.datatype)
    items = parsed.items
    results: list[dict[str, np.ndarray]] = [{}] * len(items)
    todo = iter(range(len(items)))

    async def worker() -> None:
        # One iterator shared by the workers: next() and the submit have no await
        # between them, so each item is taken once.
        for i in todo:
            item = items[i]
            if isinstance(item, bytes):
                arr = np.empty((1, 1), dtype=object)
                arr[0, 0] = item
            else:
                arr = np.array([item], dtype=dtype)
            size, key = check_shapes(
                {config.input: arr.shape}, runtime.input_specs, runtime.name,
                runtime.max_batch_size, runtime.variable_shapes,
            )  # fmt: skip
            results[i] = await runtime.infer(
                {config.input: arr}, size, key, timeout_s, None, None, arrival=arrival
            )

    # Enough to fill every instance's batch, and never more than the queue holds: a
    # request's own items alone must not find it full.
    fill = runtime.max_batch_size * runtime.config.instances
    window = min(len(items), max(1, min(fill, runtime.config.batching.max_queue_size)))
    if window == 1:
        await worker()
        return results
    tasks = [asyncio.ensure_future(worker()) for _ in range(window)]
    try:
        await asyncio.gather(*tasks)
    finally:
        # After a failure (or when this request is cancelled): the other items leave
        # the batcher's queue; their own errors are retrieved here and dropped.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def _answer(parsed: EmbeddingRequest, outputs: list[dict[str, np.ndarray]]) -> bytes:
    """OpenAI's answer: the embeddings in input order, their usage."""
    config = parsed.config
    data = []
    tokens = 0
    for i, (item, out) in enumerate(zip(parsed.items, outputs, strict=True)):
        vector = answer_vector(out[config.output].reshape(-1), parsed.dimensions)
        embedding: Any = vector
        if parsed.base64:
            embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
        if config.token_count_output is not None:
            tokens += int(out[config.token_count_output].reshape(-1)[0])
        else:
            tokens += len(item)
    doc = {
        "object": "list",
        "data": data,
        "model": parsed.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
