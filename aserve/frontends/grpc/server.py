"""The grpc.aio frontend: its server, listeners, health and graceful stop
(frontends layer, on the loop).

It runs on the same event loop as the aiohttp frontend and shares everything
behind it: routing, the batchers, limits and statistics. The services are
KServe V2 (:mod:`aserve.frontends.grpc.kserve`, Triton's superset), token
generation (:mod:`aserve.frontends.grpc.generate`), health and reflection
(:mod:`aserve.frontends.grpc.health`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aserve._proto import aserve_pb2_grpc
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.frontends.grpc.arrival import ArrivalInterceptor
from aserve.frontends.grpc.auth import GrpcAuthInterceptor, grpc_server_credentials
from aserve.frontends.grpc.calls import InFlight
from aserve.frontends.grpc.generate import SERVICE_NAME as GENERATION_SERVICE
from aserve.frontends.grpc.generate import GenerationServicer
from aserve.frontends.grpc.health import REFLECTED_SERVICES, Health, reflection_pool
from aserve.frontends.grpc.kserve import InferenceServicer
from aserve.obs.fd_limit import fds_in_use, open_file_limit

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext

log = logging.getLogger("aserve.grpc")

# What a gRPC connection may hold (see docs/reference/grpc.md): one that
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


# How often model readiness is looked at for the health service (see _watch_readiness).
_READINESS_POLL_S = 0.2


class GrpcFrontend:
    """The grpc.aio server: its listeners, services and graceful stop."""

    def __init__(self, ctx: FrontendContext) -> None:
        assert ctx.config.grpc is not None
        self._ctx = ctx
        self._config = ctx.config.grpc
        self.health = Health()
        self._grpc: grpc.aio.Server | None = None
        # Inference calls (unary and streams) being served.
        self.calls = InFlight(ctx.config.limits.max_connections, ctx.metrics.requests.rejected)
        self.addresses: list[tuple[str, int]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._reported_readiness: tuple[tuple[str, bool], ...] = ()
        self._graceful: asyncio.Task[None] | None = None  # the stop close_listeners began

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        config = self._ctx.config
        limits = config.limits
        # First: the time a call arrived is noted before anything else runs for it.
        interceptors: list[grpc.aio.ServerInterceptor] = [ArrivalInterceptor()]
        if self._ctx.api_keys is not None:
            assert config.auth is not None
            interceptors.append(GrpcAuthInterceptor(self._ctx.api_keys, config.auth.open_paths))
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
            InferenceServicer(self._ctx, self.calls), server
        )
        aserve_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self._ctx, self.calls), server
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
                credentials = grpc_server_credentials(config.tls, self._ctx.base_dir)
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
        await self._report_health(self._ctx.not_ready_reason() is None)

    def _readiness(self) -> tuple[tuple[str, bool], ...]:
        return tuple((rt.label, rt.ready) for rt in self._ctx.registry)

    async def _report_health(self, server_ready: bool) -> None:
        # What was reported, taken before the report: a change while it is being
        # written makes the next poll report again.
        self._reported_readiness = self._readiness()
        await self.health.update(server_ready, self._ctx.registry)

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
            await asyncio.wait_for(self.calls.idle.wait(), timeout_s)
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
