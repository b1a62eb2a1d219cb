"""Token streaming over gRPC: ``aserve.v1.Generation/Generate`` and decoupled
``ModelStreamInfer`` responses for decoder models.

Frontends layer. Both run on the loop, in grpc.aio's handler tasks. Every check that can fail
runs before the first message. When the client cancels (or its deadline
passes), grpc.aio cancels the handler; leaving the ``async with`` of the
generation then cancels the sequence, which leaves the batch at the next step.

Writes wait for HTTP/2 flow control, so a client that reads slowly stops the
handler from reading the token channel, and its sequence is paused (see
:mod:`aserve.loop.channel`) instead of buffering without bound.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve._proto import grpc_service_pb2 as pb
from aserve.codecs.sampling import sampling_from_parameters
from aserve.codecs.v2_grpc import decode_infer_request, encode_infer_response
from aserve.config import GenerationConfig
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.common import (
    EMPTY_FINAL,
    FINAL,
    admit_and_count,
    as_error,
    bool_parameter,
    resolve_deadline,
    track_grpc,
)
from aserve.frontends.grpc.arrival import call_budget
from aserve.frontends.grpc.calls import end_call
from aserve.frontends.status import GRPC_STATUS, OK
from aserve.loop.prompt_size import check_prompt_size
from aserve.loop.runtimes.generation import (
    TEXT_OUTPUT,
    generation_runtime,
    parameter_priority,
    text_input,
    text_tensor,
)
from aserve.types.generation import BadSetting, Delta, SamplingParams, sampling_settings

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.frontends.grpc.calls import InFlight
    from aserve.loop.runtimes.base import Generator

SERVICE_NAME = "aserve.v1.Generation"
_FINISH = {
    None: apb.FINISH_REASON_UNSPECIFIED,
    "stop": apb.FINISH_REASON_STOP,
    "length": apb.FINISH_REASON_LENGTH,
}


def _status(exc: Exception, what: str) -> tuple[str, grpc.StatusCode, str]:
    """How a call ends for ``exc``: its error code, gRPC status and message."""
    error = as_error(exc, what)
    return error.code.value, GRPC_STATUS[error.code], error.message


class GenerationServicer(apb_grpc.GenerationServicer):
    """``aserve.v1.Generation``: server-streaming generation."""

    def __init__(self, ctx: FrontendContext, calls: InFlight) -> None:
        self._ctx = ctx
        self._calls = calls
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    async def Generate(
        self, request: apb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[apb.GenerateResponse]:
        runtime: Generator | None = None
        track_grpc(context, self._ctx.metrics.requests.access_log)
        gate = functools.partial(self._calls.admit, context)
        try:
            with admit_and_count(self._ctx, "grpc", lambda: runtime, gate) as call:
                try:
                    runtime = generation_runtime(
                        self._ctx.registry, request.model_name, request.model_version
                    )
                    prompt, messages = _prompt(request, runtime.generation)
                    seq = await runtime.prepare(
                        _sampling(request.sampling), prompt, messages, request.id or None
                    )
                    own = request.timeout_ms / 1e3 if request.timeout_ms else None  # 0: unset
                    arrival, budget = call_budget(context)
                    timeout = resolve_deadline(
                        None, own, budget, runtime.default_timeout_s, self._max_timeout_s
                    )
                    req = runtime.generate(seq, timeout, request.id or None, arrival=arrival)
                except Exception as exc:  # CancelledError is not an Exception: it propagates
                    call.status, code, message = _status(exc, "Generate")
                    end_call(context, code, message)
                    return
                async with req:
                    try:
                        async for delta in req:
                            yield _response(request.id, delta)
                    except Exception as exc:
                        call.status, code, message = _status(exc, "Generate")
                        end_call(context, code, message)
                        return
        except AserveError as exc:  # refused: limits.max_connections or max_concurrency
            end_call(context, GRPC_STATUS[exc.code], exc.message)


def _prompt(
    request: apb.GenerateRequest, gen: GenerationConfig
) -> tuple[str | list[int] | None, list[dict] | None]:
    """The request's one prompt, its size checked before it is copied out of the
    message (a chat's messages are counted before a dict is made for each)."""
    text = request.prompt  # each read of a string field makes a new str
    given = [
        name
        for name, present in (
            ("prompt", bool(text)),
            ("prompt_token_ids", bool(request.prompt_token_ids)),
            ("messages", bool(request.messages)),
        )
        if present
    ]
    if len(given) != 1:
        raise InvalidArgument(
            "exactly one of prompt, prompt_token_ids and messages must be set "
            f"(got {', '.join(given) or 'none'})"
        )
    if request.messages:
        check_prompt_size(gen, messages=request.messages)
        return None, [{"role": m.role, "content": m.content} for m in request.messages]
    if request.prompt_token_ids:
        # The repeated field itself: prepare() checks its length before copying it.
        return request.prompt_token_ids, None  # type: ignore[return-value]
    return text, None


def _sampling(s: apb.SamplingParameters) -> SamplingParams:
    """The request's settings, within the bounds every route checks
    (:func:`aserve.types.generation.sampling_settings`): a double must be finite."""
    given: dict[str, Any] = {"stop": list(s.stop) or None, "ignore_eos": s.ignore_eos}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if s.HasField(name):
            given[name] = getattr(s, name)
    try:
        return SamplingParams(**sampling_settings(given))
    except BadSetting as exc:
        raise InvalidArgument(f"sampling.{exc.param}: {exc.message}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"sampling.{exc.message}") from None


def _response(request_id: str, delta: Delta) -> apb.GenerateResponse:
    response = apb.GenerateResponse(id=request_id, text=delta.text, token_ids=delta.token_ids)
    if delta.finished:
        response.finish_reason = _FINISH[delta.finish_reason]
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        response.usage.total_tokens = delta.prompt_tokens + delta.completion_tokens
    return response


# --- decoupled ModelStreamInfer ---------------------------------------------------


class StreamOut(Protocol):
    """How a ModelStreamInfer call takes a request's responses."""

    async def send_partial(self, messages: list[pb.ModelStreamInferResponse]) -> None:
        """Queue responses that are not the request's last; returns once written."""

    def send_final(self, messages: list[pb.ModelStreamInferResponse]) -> None:
        """Queue the request's last responses."""


async def answer_decoupled(
    out: StreamOut,
    runtime: Generator,
    request: pb.ModelInferRequest,
    call_remaining: float | None,
    max_timeout_s: float,
) -> str:
    """One request of a ModelStreamInfer call on a decoder model: a response per
    piece of text (``text_output``), the last flagged ``triton_final_response``
    and carrying ``finish_reason``, ``prompt_tokens`` and ``completion_tokens``
    parameters. A failure answers ``error_message``, and the stream goes on.
    Returns how it ended, for the request counters: "ok" or the error code."""
    try:
        decoded = decode_infer_request(
            request, runtime.name, runtime.input_specs, runtime.output_specs,
            runtime.max_batch_size, runtime.variable_shapes,
        )  # fmt: skip
        params = sampling_from_parameters(decoded.parameters)
        priority = parameter_priority(decoded.parameters)  # vLLM's, as over HTTP
        client_id = request.id or None
        prompt = text_input(decoded.inputs, runtime.generation.prompt_bytes_limit)
        seq = await runtime.prepare(params, prompt, client_id=client_id, priority=priority)
        timeout = resolve_deadline(
            None, decoded.timeout_s, call_remaining, runtime.default_timeout_s, max_timeout_s
        )
        req = runtime.generate(seq, timeout, client_id, priority=priority)
    except Exception as exc:
        error = as_error(exc, "ModelStreamInfer", request.id)
        out.send_final([failed_response(request, error)])
        return error.code.value
    empty_final = bool_parameter(request, EMPTY_FINAL)
    async with req:
        try:
            async for delta in req:
                if not delta.text and not delta.finished:
                    continue
                response = encode_infer_response(
                    runtime.name, runtime.version, decoded,
                    {TEXT_OUTPUT: text_tensor(delta.text)}, runtime.output_specs,
                )  # fmt: skip
                final = delta.finished and not empty_final
                response.parameters[FINAL].bool_param = final
                if delta.finished:
                    p = response.parameters
                    p["finish_reason"].string_param = delta.finish_reason or ""
                    p["prompt_tokens"].int64_param = delta.prompt_tokens
                    p["completion_tokens"].int64_param = delta.completion_tokens
                message = pb.ModelStreamInferResponse(infer_response=response)
                if final:
                    out.send_final([message])
                    return OK
                await out.send_partial([message])
        except Exception as exc:
            error = as_error(exc, "ModelStreamInfer", request.id)
            out.send_final([failed_response(request, error)])
            return error.code.value
    last = pb.ModelInferResponse(
        model_name=runtime.name, model_version=runtime.version, id=request.id
    )
    last.parameters[FINAL].bool_param = True
    out.send_final([pb.ModelStreamInferResponse(infer_response=last)])
    return OK


def failed_response(
    request: pb.ModelInferRequest, error: AserveError
) -> pb.ModelStreamInferResponse:
    failed = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    failed.parameters[FINAL].bool_param = True
    return pb.ModelStreamInferResponse(error_message=error.message, infer_response=failed)
