"""KServe V2 over gRPC: ``inference.GRPCInferenceService`` (frontends layer; handlers on the loop).

Handlers decode a ModelInferRequest, submit it through
:meth:`Runtime.infer` and encode the answer. Errors end the call with the
gRPC code from :data:`aserve.frontends.status.GRPC_STATUS` and a message
naming the field or tensor; on ModelStreamInfer they travel per request in
``error_message`` and the stream goes on.

Deadlines and cancellation: the request's timeout is the earlier of the
call's deadline and its ``timeout_ms`` / ``timeout`` parameter, else the
model's default (:func:`aserve.frontends.common.resolve_deadline`), counted
from when the call arrived (:mod:`aserve.frontends.grpc.arrival`). A client
that cancels, or whose deadline passes, makes grpc.aio cancel the handler;
the request then leaves its queue.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc
from google.protobuf import json_format

from aserve import __version__
from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.codecs.v2 import DecodedRequest
from aserve.codecs.v2_grpc import decode_infer_request, encode_infer_response
from aserve.codecs.validate import same_io
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.common import (
    EMPTY_FINAL,
    FINAL,
    admit_and_count,
    as_error,
    bool_parameter,
    model_metadata,
    resolve_deadline,
    track_grpc,
)
from aserve.frontends.grpc.arrival import call_budget
from aserve.frontends.grpc.calls import end_call
from aserve.frontends.grpc.decoupled import answer_responses
from aserve.frontends.grpc.generate import answer_decoupled
from aserve.frontends.load_override import refuse_override_files, repository_load
from aserve.frontends.model_config import triton_config_message
from aserve.frontends.shm_regions import NO_GPU
from aserve.frontends.status import GRPC_STATUS
from aserve.loop.runtimes.base import Decoupled, Generator

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.frontends.grpc.calls import InFlight
    from aserve.loop.runtimes.base import Runtime

EXTENSIONS: Final = [
    "parameters", "statistics", "model_repository", "model_configuration", "system_shared_memory",
]  # fmt: skip
# Requests one stream may have in flight (read, not yet answered). Past it the
# stream stops reading, and HTTP/2 flow control pushes back on the client.
STREAM_MAX_IN_FLIGHT: Final = 1024

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_Handler = Callable[[Any, _Request, grpc.aio.ServicerContext], Awaitable[_Response]]


def _unary(method: _Handler[_Request, _Response]) -> _Handler[_Request, _Response | None]:
    """End the call with the error's gRPC status when ``method`` raises."""

    @functools.wraps(method)
    async def handler(
        self: Any, request: _Request, context: grpc.aio.ServicerContext
    ) -> _Response | None:
        try:
            return await method(self, request, context)
        except Exception as exc:  # CancelledError is not an Exception: it propagates
            error = as_error(exc, method.__name__, getattr(request, "id", ""))
        end_call(context, GRPC_STATUS[error.code], error.message)
        return None  # no message goes with an error status

    return handler


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``; RPCs not defined here answer UNIMPLEMENTED."""

    def __init__(self, ctx: FrontendContext, calls: InFlight) -> None:
        self._ctx = ctx
        self._calls = calls
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3

    def _runtime(self, name: str, version: str) -> Runtime:
        return self._ctx.registry.get(name, version or None)

    def _every_runtime(self) -> list[Runtime]:
        return sorted(self._ctx.registry, key=lambda rt: (rt.name, int(rt.version)))

    # --- health and metadata --------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ctx.not_ready_reason() is None)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        # An unknown model is "not ready" rather than an error: what Triton's
        # clients expect from a readiness probe.
        try:
            runtime = self._runtime(request.name, request.version)
        except AserveError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=runtime.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="aserve", version=__version__, extensions=EXTENSIONS)

    @_unary
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        runtime = self._runtime(request.name, request.version)
        return json_format.ParseDict(
            model_metadata(self._ctx.registry, runtime), pb.ModelMetadataResponse()
        )

    @_unary
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        runtime = self._runtime(request.name, request.version)
        return pb.ModelConfigResponse(config=triton_config_message(runtime.triton_config()))

    @_unary
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        # The same selection as HTTP's /stats: one model (its highest version
        # unless one is named), or every model when no name is given.
        if request.name:
            runtimes = [self._runtime(request.name, request.version)]
        else:
            runtimes = self._every_runtime()
        response = pb.ModelStatisticsResponse()
        for rt in runtimes:
            # aserve's own gauges (pending_request_count, ...) have no field here.
            json_format.ParseDict(
                rt.statistics(), response.model_stats.add(), ignore_unknown_fields=True
            )
        return response

    @_unary
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        # Every model of the config, loaded or not, as over HTTP.
        response = pb.RepositoryIndexResponse()
        for entry in self._ctx.reloader.index(ready_only=request.ready):
            # The footprint (HTTP's "memory") has no field here: /metrics has it.
            response.models.add(
                name=entry["name"], version=entry["version"], state=entry["state"],
                reason=entry["reason"],
            )  # fmt: skip
        return response

    @_unary
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        # As HTTP's POST .../load: the "config" parameter is an override, as JSON text.
        params = request.parameters
        refuse_override_files(params)
        config = None
        if "config" in params:
            if params["config"].WhichOneof("parameter_choice") != "string_param":
                raise InvalidArgument(
                    "parameter 'config' must be a string_param: the model's config as JSON text"
                )
            config = params["config"].string_param
        await repository_load(self._ctx, request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_unary
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        dependents = False
        if "unload_dependents" in request.parameters:
            param = request.parameters["unload_dependents"]
            if param.WhichOneof("parameter_choice") != "bool_param":
                raise InvalidArgument("parameter 'unload_dependents' must be a bool_param")
            dependents = param.bool_param
        await self._ctx.reloader.unload_model(request.model_name, dependents)
        return pb.RepositoryModelUnloadResponse()

    # --- shared memory (Triton's extensions) ---------------------------------

    @_unary
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self._ctx.shared_memory.status(request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    @_unary
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self._ctx.shared_memory.register(
            request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self._ctx.shared_memory.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_unary
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Any
    ) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise InvalidArgument(f"Unable to find cuda shared memory region: '{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    @_unary
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Any
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise InvalidArgument(NO_GPU)

    @_unary
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Any
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing is ever registered

    # --- inference ------------------------------------------------------------

    async def _infer(
        self, request: pb.ModelInferRequest, deadline_s: float | None, arrival: float | None
    ) -> pb.ModelInferResponse:
        """Run one request that arrived at ``arrival`` (None: now); ``deadline_s`` is
        the call's deadline in seconds from then, if bounded."""
        runtime = self._runtime(request.model_name, request.model_version)
        decoded = decode_infer_request(
            request,
            runtime.name,
            runtime.input_specs,
            runtime.output_specs,
            runtime.max_batch_size,
            runtime.variable_shapes,
            max_elements=self._ctx.config.limits.max_tensor_elements,
            defer=True,
            shm=self._ctx.shared_memory,
        )
        if not decoded.shm_held:
            return await self._run(request, runtime, decoded, deadline_s, arrival)
        try:  # the regions it uses stay mapped until its answer is encoded
            return await self._run(request, runtime, decoded, deadline_s, arrival)
        finally:
            decoded.release_shared_memory()

    async def _run(
        self,
        request: pb.ModelInferRequest,
        runtime: Runtime,
        decoded: DecodedRequest,
        deadline_s: float | None,
        arrival: float | None,
    ) -> pb.ModelInferResponse:
        if decoded.pending:  # much data: decoded on a thread, then routing is looked up again
            await asyncio.to_thread(decoded.decode_pending)
            runtime = same_io(runtime, self._runtime(request.model_name, request.model_version))
        # Past the call's deadline nobody waits for the answer.
        timeout = resolve_deadline(
            None, decoded.timeout_s, deadline_s, runtime.default_timeout_s, self._max_timeout_s
        )
        outputs = await runtime.infer(
            decoded.inputs,
            decoded.batch_size,
            decoded.shape_key,
            timeout,
            decoded.client_id,
            decoded.parameters,
            arrival=arrival,
        )
        return encode_infer_response(
            runtime.name, runtime.version, decoded, outputs, runtime.output_specs
        )

    def _served(self, request: pb.ModelInferRequest) -> Runtime | None:
        """The runtime that serves ``request`` now, if any (for counting it)."""
        try:
            return self._runtime(request.model_name, request.model_version)
        except AserveError:
            return None

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse | None:
        track_grpc(context, self._ctx.metrics.requests.access_log)
        try:
            served = functools.partial(self._served, request)
            gate = functools.partial(self._calls.admit, context)
            with admit_and_count(self._ctx, "grpc", served, gate):
                arrival, budget = call_budget(context)
                return await self._infer(request, budget, arrival)
        except Exception as exc:  # CancelledError is not an Exception: it propagates
            error = as_error(exc, "ModelInfer", request.id)
        end_call(context, GRPC_STATUS[error.code], error.message)
        return None  # no message goes with an error status

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            self._calls.check_capacity()
        except AserveError as exc:
            end_call(context, GRPC_STATUS[exc.code], exc.message)
            return
        self._calls.serving(context)
        await _Stream(self, context).run(request_iterator)


class _Stream:
    """One ModelStreamInfer call: a reader, one task per request, one writer.

    Requests run concurrently and are answered as they finish, so responses
    may leave out of order; each carries its request's id. When the client
    half-closes, the requests in flight are answered and the call ends OK.
    When the call is cancelled, every request still in flight is cancelled
    and leaves its queue. A request to a decoder model is answered as it
    generates (decoupled: a response per piece of text, see
    :func:`aserve.frontends.grpc.generate.answer_decoupled`), one to a
    decoupled model with a message per response it yields
    (:func:`aserve.frontends.grpc.decoupled.answer_responses`).
    """

    def __init__(self, servicer: InferenceServicer, context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self._context = context
        # A request's responses (two with an empty final one), and for one that is
        # not its last (decoupled), a future set once written; None ends the call.
        self._outbox: asyncio.Queue[
            tuple[list[pb.ModelStreamInferResponse], asyncio.Future[None] | None] | None
        ] = asyncio.Queue()
        self._slots = asyncio.Semaphore(STREAM_MAX_IN_FLIGHT)
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        reader = asyncio.create_task(self._read(requests), name="grpc-stream-reader")
        try:
            while (entry := await self._outbox.get()) is not None:
                messages, written = entry
                for message in messages:
                    await self._context.write(message)
                if written is None:
                    self._slots.release()  # the request's last answer
                elif not written.done():
                    written.set_result(None)
            await reader  # re-raises whatever ended the reading early
        finally:
            reader.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(reader, *self._tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        try:
            async for request in requests:
                await self._slots.acquire()
                task = asyncio.create_task(self._answer(request), name=f"grpc-stream-{request.id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            # Half-closed: nothing new can arrive, so these are the last ones.
            await asyncio.gather(*self._tasks)
        finally:
            self._outbox.put_nowait(None)

    def send_final(self, messages: list[pb.ModelStreamInferResponse]) -> None:
        self._outbox.put_nowait((messages, None))

    async def send_partial(self, messages: list[pb.ModelStreamInferResponse]) -> None:
        # Waiting for the write bounds what a decoupled request queues here.
        written = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait((messages, written))
        await written

    async def _answer(self, request: pb.ModelInferRequest) -> None:
        try:
            runtime = self._servicer._runtime(request.model_name, request.model_version)
        except AserveError:
            runtime = None  # _infer answers the error
        ctx = self._servicer._ctx
        track_grpc(self._context, ctx.metrics.requests.access_log)  # this task's own
        try:
            # Each request of the stream is admitted and counted.
            with admit_and_count(ctx, "grpc", lambda: runtime) as call:
                if isinstance(runtime, Generator):
                    call.status = await answer_decoupled(
                        self, runtime, request, self._context.time_remaining(),
                        self._servicer._max_timeout_s,
                    )  # fmt: skip
                    return
                if isinstance(runtime, Decoupled):
                    call.status = await answer_responses(
                        self, runtime, request, self._context.time_remaining(),
                        self._servicer._max_timeout_s, ctx.config.limits.max_tensor_elements,
                        ctx.shared_memory,
                    )  # fmt: skip
                    return
                # Counted from now: it was read just now, long after the call began.
                response = await self._servicer._infer(
                    request, self._context.time_remaining(), None
                )
        except Exception as exc:  # CancelledError (the stream is going away) propagates
            error = as_error(exc, "ModelStreamInfer", request.id)
            failed = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            failed.parameters[FINAL].bool_param = True
            self.send_final(
                [pb.ModelStreamInferResponse(error_message=error.message, infer_response=failed)]
            )
            return
        empty_final = bool_parameter(request, EMPTY_FINAL)
        response.parameters[FINAL].bool_param = not empty_final
        messages = [pb.ModelStreamInferResponse(infer_response=response)]
        if empty_final:
            final = pb.ModelInferResponse(
                model_name=response.model_name, model_version=response.model_version, id=response.id
            )
            final.parameters[FINAL].bool_param = True
            messages.append(pb.ModelStreamInferResponse(infer_response=final))
        self.send_final(messages)
