"""The grpc.aio frontend: KServe V2 gRPC (Triton's superset), health, reflection.

It runs on the same event loop as the aiohttp frontend and shares everything
behind it: routing, the batchers, limits and statistics. Handlers decode a
ModelInferRequest, submit it through :meth:`ModelRuntime.infer` and encode
the answer. Errors end the call with the gRPC code from
:data:`aserve.frontends.status.GRPC_STATUS` and a message naming the field or
tensor; on ModelStreamInfer they travel per request in ``error_message`` and
the stream goes on.

Deadlines and cancellation: the call's deadline becomes the request's
deadline (or the ``timeout`` parameter, if sooner). A client that cancels, or
whose deadline passes, makes grpc.aio cancel the handler; the request then
leaves its queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aserve import __version__
from aserve._proto import aserve_pb2_grpc
from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.codecs.v2_grpc import decode_infer_request, encode_infer_response
from aserve.codecs.validate import same_io
from aserve.errors import AserveError, ErrorCode, InternalError, QueueFull
from aserve.frontends.auth import GrpcAuthInterceptor, grpc_server_credentials
from aserve.frontends.grpc_generate import SERVICE_NAME as GENERATION_SERVICE
from aserve.frontends.grpc_generate import GenerationServicer, answer_decoupled
from aserve.frontends.grpc_health import REFLECTED_SERVICES, Health, reflection_pool
from aserve.frontends.model_config import triton_config_message
from aserve.frontends.status import GRPC_STATUS
from aserve.logs import track_grpc
from aserve.loop.deadline import request_timeout_s
from aserve.loop.fd_limit import fds_in_use, open_file_limit
from aserve.loop.runtimes.generation import GenerationRuntime
from aserve.metrics import OK

if TYPE_CHECKING:
    from aserve.loop.runtime import Server
    from aserve.loop.runtimes.base import Runtime as ModelRuntime

log = logging.getLogger("aserve.grpc")

EXTENSIONS: Final = ["parameters", "statistics", "model_configuration"]
# Requests one stream may have in flight (read, not yet answered). Past it the
# stream stops reading, and HTTP/2 flow control pushes back on the client.
STREAM_MAX_IN_FLIGHT: Final = 1024
_FINAL = "triton_final_response"
_EMPTY_FINAL = "triton_enable_empty_final_response"

# What a gRPC connection may hold (see the README's "gRPC" section): one that
# has not finished its handshake (HTTP/2 preface and settings, TLS) within
# http.header_timeout_s is closed, as over HTTP; one without calls for
# _IDLE_MS is sent GOAWAY (clients reconnect by themselves); a peer that
# vanished is found by keepalive pings (_PING_MS, answered within
# _PING_TIMEOUT_MS) even under an open stream. grpc's defaults already
# answer clients that ping too often with GOAWAY.
_IDLE_MS: Final = 300_000
_PING_MS: Final = 120_000
_PING_TIMEOUT_MS: Final = 20_000
# Calls one connection may have open at once: more wait on the client.
_MAX_STREAMS: Final = 1024


def _connection_options(handshake_timeout_s: float) -> list[tuple[str, int]]:
    options = [
        ("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout_s * 1e3))),
        ("grpc.max_connection_idle_ms", _IDLE_MS),
        ("grpc.keepalive_time_ms", _PING_MS),
        ("grpc.keepalive_timeout_ms", _PING_TIMEOUT_MS),
        ("grpc.max_concurrent_streams", _MAX_STREAMS),
    ]
    fd_limit = open_file_limit()
    if fd_limit is not None:
        # A quarter of the descriptors left: sockets on the gRPC port cannot
        # exhaust what HTTP needs (HTTP's pending connections get half).
        # Clients multiplex calls on a channel, so few connections are normal.
        most = max(16, (fd_limit - fds_in_use()) // 4)
        options.append(("grpc.max_allowed_incoming_connections", most))
    return options


_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_Handler = Callable[[Any, _Request, grpc.aio.ServicerContext], Awaitable[_Response]]


def _as_error(exc: Exception, rpc: str, request: Any) -> AserveError:
    if isinstance(exc, AserveError):
        return exc
    # A bug, not the client's fault: answer INTERNAL and keep serving.
    log.exception("%s (request id %r) failed unexpectedly", rpc, getattr(request, "id", ""))
    return InternalError(f"internal error: {exc!r}")


def _unary(method: _Handler[_Request, _Response]) -> _Handler[_Request, _Response]:
    """End the call with the error's gRPC status when ``method`` raises."""

    @functools.wraps(method)
    async def handler(self: Any, request: _Request, context: grpc.aio.ServicerContext) -> _Response:
        try:
            return await method(self, request, context)
        except Exception as exc:  # CancelledError is not an Exception: it propagates
            error = _as_error(exc, method.__name__, request)
        await context.abort(GRPC_STATUS[error.code], error.message)
        raise AssertionError("unreachable: abort raises")

    return handler


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``; RPCs not defined here answer UNIMPLEMENTED."""

    def __init__(self, server: Server, frontend: GrpcFrontend) -> None:
        self._server = server
        self._frontend = frontend
        self._max_timeout_s = server.config.limits.max_timeout_ms / 1e3

    def _runtime(self, name: str, version: str) -> ModelRuntime:
        return self._server.registry.get(name, version or None)

    def _every_runtime(self) -> list[ModelRuntime]:
        return sorted(self._server.registry, key=lambda rt: (rt.name, int(rt.version)))

    # --- health and metadata --------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._server.not_ready_reason() is None)

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
        return json_format.ParseDict(
            self._runtime(request.name, request.version).metadata(), pb.ModelMetadataResponse()
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
        for entry in self._server.reloader.index(ready_only=request.ready):
            response.models.add(**entry)
        return response

    # --- inference ------------------------------------------------------------

    async def _infer(
        self, request: pb.ModelInferRequest, deadline_s: float | None
    ) -> pb.ModelInferResponse:
        """Run one request; ``deadline_s`` is the seconds the call has left, if bounded."""
        runtime = self._runtime(request.model_name, request.model_version)
        decoded = decode_infer_request(
            request,
            runtime.name,
            runtime.input_specs,
            runtime.output_specs,
            runtime.max_batch_size,
            runtime.variable_shapes,
            max_elements=self._server.config.limits.max_tensor_elements,
            defer=True,
        )
        if decoded.pending:  # much data: decoded on a thread, then routing is looked up again
            await asyncio.to_thread(decoded.decode_pending)
            runtime = same_io(runtime, self._runtime(request.model_name, request.model_version))
        # Past the call's deadline nobody waits for the answer.
        timeout = request_timeout_s(
            (decoded.timeout_s, deadline_s), runtime.default_timeout_s, self._max_timeout_s
        )
        outputs = await runtime.infer(
            decoded.inputs,
            decoded.batch_size,
            decoded.shape_key,
            timeout,
            decoded.client_id,
            decoded.parameters,
        )
        return encode_infer_response(
            runtime.name, runtime.version, decoded, outputs, runtime.output_specs
        )

    def _served(self, request: pb.ModelInferRequest) -> ModelRuntime | None:
        """The runtime that serves ``request`` now, if any (for counting it)."""
        try:
            return self._runtime(request.model_name, request.model_version)
        except AserveError:
            return None

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        started = perf_counter()
        record = self._server.metrics.requests.record
        track_grpc(context, self._server.metrics.requests.access_log)
        try:
            self._frontend.check_capacity()
            self._frontend.serving(context)
            with self._server.admission:
                response = await self._infer(request, context.time_remaining())
        except asyncio.CancelledError:
            record(self._served(request), "grpc", ErrorCode.CANCELLED.value, started)
            raise
        except Exception as exc:
            error = _as_error(exc, "ModelInfer", request)
            record(self._served(request), "grpc", error.code.value, started)
            await context.abort(GRPC_STATUS[error.code], error.message)
            raise AssertionError("unreachable: abort raises") from None
        record(self._served(request), "grpc", OK, started)
        return response

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            self._frontend.check_capacity()
        except AserveError as exc:
            await context.abort(GRPC_STATUS[exc.code], exc.message)
        self._frontend.serving(context)
        await _Stream(self, context).run(request_iterator)


class _Stream:
    """One ModelStreamInfer call: a reader, one task per request, one writer.

    Requests run concurrently and are answered as they finish, so responses
    may leave out of order; each carries its request's id. When the client
    half-closes, the requests in flight are answered and the call ends OK.
    When the call is cancelled, every request still in flight is cancelled
    and leaves its queue. A request to a decoder model is answered as it
    generates (decoupled: a response per piece of text, see
    :func:`aserve.frontends.grpc_generate.answer_decoupled`).
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
        server = self._servicer._server
        started = perf_counter()
        record = server.metrics.requests.record
        track_grpc(self._context, server.metrics.requests.access_log)  # this task's own
        try:
            with server.admission:  # each request of the stream counts
                if isinstance(runtime, GenerationRuntime):
                    status = await answer_decoupled(
                        self, runtime, request, self._context.time_remaining(),
                        self._servicer._max_timeout_s,
                    )  # fmt: skip
                    record(runtime, "grpc", status, started)
                    return
                response = await self._servicer._infer(request, self._context.time_remaining())
        except asyncio.CancelledError:  # the stream is going away
            record(runtime, "grpc", ErrorCode.CANCELLED.value, started)
            raise
        except Exception as exc:
            error = _as_error(exc, "ModelStreamInfer", request)
            record(runtime, "grpc", error.code.value, started)
            failed = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            failed.parameters[_FINAL].bool_param = True
            self.send_final(
                [pb.ModelStreamInferResponse(error_message=error.message, infer_response=failed)]
            )
            return
        record(runtime, "grpc", OK, started)
        empty_final = _bool_parameter(request, _EMPTY_FINAL)
        response.parameters[_FINAL].bool_param = not empty_final
        messages = [pb.ModelStreamInferResponse(infer_response=response)]
        if empty_final:
            final = pb.ModelInferResponse(
                model_name=response.model_name, model_version=response.model_version, id=response.id
            )
            final.parameters[_FINAL].bool_param = True
            messages.append(pb.ModelStreamInferResponse(infer_response=final))
        self.send_final(messages)


def _bool_parameter(request: pb.ModelInferRequest, key: str) -> bool:
    param = request.parameters.get(key)
    return (
        param is not None
        and param.WhichOneof("parameter_choice") == "bool_param"
        and param.bool_param
    )


# How often model readiness is looked at for the health service (see _watch_readiness).
_READINESS_POLL_S = 0.2


class GrpcFrontend:
    """The grpc.aio server: its listeners, services and graceful stop."""

    def __init__(self, server: Server) -> None:
        assert server.config.grpc is not None
        self._server = server
        self._config = server.config.grpc
        self.health = Health()
        self._grpc: grpc.aio.Server | None = None
        self.inflight = 0  # inference calls (unary and streams) being served
        self._max_calls = server.config.limits.max_connections
        self._idle = asyncio.Event()
        self._idle.set()
        self.addresses: list[tuple[str, int]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._reported_readiness: tuple[tuple[str, bool], ...] = ()
        self._graceful: asyncio.Task[None] | None = None  # the stop close_listeners began

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        config = self._server.config
        limits = config.limits
        interceptors = []
        if self._server.api_keys is not None:
            assert config.auth is not None
            interceptors.append(GrpcAuthInterceptor(self._server.api_keys, config.auth.open_paths))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                # The limit is on what clients send (one message of a stream
                # each); answers may be larger, as over HTTP.
                ("grpc.max_receive_message_length", limits.max_request_bytes),
                ("grpc.max_send_message_length", -1),
                # grpc's default SO_REUSEPORT would let a second server bind
                # the same port and silently share its traffic.
                ("grpc.so_reuseport", 0),
                *_connection_options(config.http.header_timeout_s),
            ],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(self._server, self), server
        )
        aserve_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self._server, self), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (*REFLECTED_SERVICES, GENERATION_SERVICE), server, pool=reflection_pool()
        )
        await self._report_health(False)
        host = self._config.host
        address = f"[{host}]:{self._config.port}" if ":" in host else f"{host}:{self._config.port}"
        try:
            if config.tls is None:
                port = server.add_insecure_port(address)
            else:
                credentials = grpc_server_credentials(config.tls, self._server.base_dir)
                port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:  # grpc's way of saying the bind failed
            raise OSError(f"gRPC cannot listen on {address}: {exc}") from None
        await server.start()
        self._grpc = server
        self.addresses = [(host, port)]
        self._watcher = asyncio.create_task(self._watch_readiness())
        log.info("gRPC (KServe V2) listening on %s:%d", host, port)

    async def update_health(self) -> None:
        """Report readiness again (the server's or a model's changed)."""
        await self._report_health(self._server.not_ready_reason() is None)

    def _readiness(self) -> tuple[tuple[str, bool], ...]:
        return tuple((rt.label, rt.ready) for rt in self._server.registry)

    async def _report_health(self, server_ready: bool) -> None:
        # What was reported, taken before the report: a change while it is being
        # written makes the next poll report again.
        self._reported_readiness = self._readiness()
        await self.health.update(server_ready, self._server.registry)

    async def _watch_readiness(self) -> None:
        """A model also turns not ready, and back, with no event here (an
        executor thread or step process being restarted): look a few times a
        second and report what differs from the last report, so health
        watchers hear of it (a change before the first look included)."""
        while True:
            await asyncio.sleep(_READINESS_POLL_S)
            if self._readiness() != self._reported_readiness:
                await self.update_health()

    async def begin_drain(self) -> None:
        """Health turns NOT_SERVING for good; calls are still served as before."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        await self.health.draining()

    def close_listeners(self, grace_s: float) -> None:
        """Stop accepting connections and calls (GOAWAY); calls in flight go on
        for up to ``grace_s``, then they are cancelled."""
        if self._grpc is not None and self._graceful is None:
            self._graceful = asyncio.create_task(self._grpc.stop(grace_s))

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no inference call is in flight (True), or ``timeout_s`` passed."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self, cut_off_s: float = 0.0) -> None:
        """End what is left: inference calls still running after a drain get
        ``cut_off_s`` to answer (a stream its final error), then everything is
        cancelled. (A graceful stop would also wait for health watches and
        reflection streams, which never end by themselves.)"""
        await self.begin_drain()
        if self._grpc is None:
            return
        if self._graceful is not None:
            await self.drain(cut_off_s)
        await self._grpc.stop(None)
        if self._graceful is not None:
            await self._graceful
            self._graceful = None
        self._grpc = None

    def check_capacity(self) -> None:
        """Raise :class:`QueueFull` when ``limits.max_connections`` inference calls
        are in flight. Call right before ``serving()``, with no await between."""
        if self._max_calls is not None and self.inflight >= self._max_calls:
            rejected = self._server.metrics.requests.rejected
            rejected["max_connections"] = rejected.get("max_connections", 0) + 1
            raise QueueFull(
                f"server has {self.inflight} gRPC inference calls in flight, its limit "
                f"limits.max_connections is {self._max_calls}; retry later"
            )

    def serving(self, context: grpc.aio.ServicerContext) -> None:
        """Count an inference call as in flight until grpc has sent its status.

        Not until the handler returns: its answer is written after that, and
        a drain that ended at the return would let the final stop cancel an
        answer still on its way (the client sees CANCELLED or a GOAWAY)."""
        self.inflight += 1
        self._idle.clear()
        context.add_done_callback(self._call_done)

    def _call_done(self, _context: object) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()
