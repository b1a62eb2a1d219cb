"""A decoupled model's responses over gRPC ``ModelStreamInfer`` (frontends layer;
runs on the loop, in the stream's task for the request).

A request to a :class:`~aserve.loop.runtimes.base.Decoupled` runtime is
decoded as ModelInfer's is, and each response the model yields goes out as a
``ModelStreamInferResponse`` at once, with ``triton_final_response`` false:
the last one cannot be told from the others until the model ends. Then, as
Triton does, the end is an empty response flagged final when the request
asked for one (``triton_enable_empty_final_response``, tritonclient's
``enable_empty_final_response=True``), and nothing otherwise. A failure,
before the first response or after, is an ``error_message`` flagged final,
and the stream goes on. Writes wait for HTTP/2 flow control, so a client
that reads slowly holds the model's generator at its ``yield``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aserve._proto import grpc_service_pb2 as pb
from aserve.codecs.v2_grpc import decode_infer_request, encode_infer_response
from aserve.frontends.common import EMPTY_FINAL, FINAL, as_error, bool_parameter, resolve_deadline
from aserve.frontends.grpc.generate import StreamOut, failed_response
from aserve.frontends.status import OK

if TYPE_CHECKING:
    from aserve.codecs.shm import SharedMemory
    from aserve.loop.runtimes.base import Decoupled


async def answer_responses(
    out: StreamOut,
    runtime: Decoupled,
    request: pb.ModelInferRequest,
    call_remaining: float | None,
    max_timeout_s: float,
    max_elements: int | None,
    shm: SharedMemory | None,
) -> str:
    """One request of a ModelStreamInfer call on a decoupled model, answered as
    the module says. Returns how it ended, for the request counters: "ok" or
    the error code."""
    empty_final = bool_parameter(request, EMPTY_FINAL)
    try:
        decoded = decode_infer_request(
            request, runtime.name, runtime.input_specs, runtime.output_specs,
            runtime.max_batch_size, runtime.variable_shapes,
            max_elements=max_elements, defer=True, shm=shm,
        )  # fmt: skip
    except Exception as exc:
        error = as_error(exc, "ModelStreamInfer", request.id)
        out.send_final([failed_response(request, error)])
        return error.code.value
    try:
        if decoded.pending:  # much data: decoded on a thread
            await asyncio.to_thread(decoded.decode_pending)
        timeout = resolve_deadline(
            None, decoded.timeout_s, call_remaining, runtime.default_timeout_s, max_timeout_s
        )
        stream = runtime.stream(
            decoded.inputs, decoded.batch_size, timeout, decoded.client_id, decoded.parameters
        )
        async with stream:
            async for outputs in stream:
                response = encode_infer_response(
                    runtime.name, runtime.version, decoded, outputs, runtime.output_specs
                )
                response.parameters[FINAL].bool_param = False
                await out.send_partial([pb.ModelStreamInferResponse(infer_response=response)])
    except Exception as exc:  # CancelledError (the stream is going away) propagates
        error = as_error(exc, "ModelStreamInfer", request.id)
        out.send_final([failed_response(request, error)])
        return error.code.value
    finally:
        decoded.release_shared_memory()
    if not empty_final:
        out.send_final([])
        return OK
    last = pb.ModelInferResponse(
        model_name=runtime.name, model_version=runtime.version, id=request.id
    )
    last.parameters[FINAL].bool_param = True
    out.send_final([pb.ModelStreamInferResponse(infer_response=last)])
    return OK
