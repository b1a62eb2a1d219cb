"""The server's lifecycle: starting -> ready -> draining -> stopped.

Startup binds the listeners first, then loads and warms every model before
readiness turns true. SIGINT or
SIGTERM starts a graceful stop: readiness turns false, the listeners close,
in-flight requests finish (bounded by ``drain_timeout_s``), then the models
unload in reverse order of loading. A second signal skips the wait.

While ready, the config file is watched and SIGHUP re-reads it; changes are
applied by :class:`aserve.loop.reload.Reloader` without a restart.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
from pathlib import Path

from aserve.config import ServerConfig
from aserve.engines.gpu_memory import CacheReleaser, apply_memory_limit, cuda_indices, gpu_present
from aserve.frontends.auth import ApiKeys, load_api_keys
from aserve.frontends.grpc import GrpcFrontend
from aserve.frontends.http import HttpFrontend
from aserve.loop.fd_limit import raise_open_file_limit
from aserve.loop.limits import Admission
from aserve.loop.registration import Registration
from aserve.loop.registry import ModelRegistry
from aserve.loop.reload import ConfigSource, Reloader
from aserve.loop.runtimes import create_runtime
from aserve.metrics import Metrics

log = logging.getLogger("aserve.server")


class ServerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class StartupError(Exception):
    """A model could not be loaded; the message says which and why."""


class Server:
    def __init__(
        self, config: ServerConfig, base_dir: Path, source: ConfigSource | None = None
    ) -> None:
        self.config = config
        self.base_dir = base_dir
        self.state = ServerState.STARTING
        self.registry = ModelRegistry()
        self.api_keys: ApiKeys | None = None
        if config.auth is not None:
            try:
                self.api_keys = load_api_keys(config.auth, base_dir)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        self.reloader = Reloader(self, source)
        self.metrics = Metrics(self)  # before the frontends, which count requests in it
        self.admission = Admission(config.limits.max_concurrency, self.metrics.requests.rejected)
        self.http = HttpFrontend(self)
        self.grpc = GrpcFrontend(self) if config.grpc is not None else None
        self._stop_requested: asyncio.Event | None = None
        self._cache_releaser: asyncio.Task[None] | None = None
        self._listening = False  # both frontends' sockets are bound
        self.registration = Registration(self)  # this server's entry for `aserve ps`

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready, or None when it is."""
        if self.state is not ServerState.READY:
            return f"server is {self.state.value}"
        down = [rt.label for rt in self.registry if not rt.ready]
        return f"model(s) not ready: {', '.join(down)}" if down else None

    async def start(self) -> None:
        """Open the listeners, then load and warm every model; ready after that."""
        self.registry.starting = True
        await self._listen()
        await self.registration.publish()
        self._apply_gpu_settings()
        runtimes = [
            create_runtime(m, self.base_dir, self.registry, self.config.gpu)
            for m in self.config.models
        ]
        results = await asyncio.gather(*(rt.load() for rt in runtimes), return_exceptions=True)
        failed = [
            f"model '{rt.label}' failed to load: {result}"
            for rt, result in zip(runtimes, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failed:
            await asyncio.gather(*(rt.unload() for rt in runtimes), return_exceptions=True)
            raise StartupError("\n".join(failed))  # run() closes the listeners
        self.registry.swap(add=runtimes)
        self.registry.starting = False
        self.state = ServerState.READY
        self.metrics.start()
        if self.grpc is not None:
            await self.grpc.update_health()
        self.reloader.start()
        log.info("ready: %d model(s) serving", len(self.registry))

    async def _listen(self) -> None:
        """Bind and keep every listening socket before any model loads: an address in
        use fails in a moment, not after minutes of loading, and no other process can
        take the port meanwhile. Until the models are ready, /v2/health/live answers
        200, /v2/health/ready and gRPC health say not ready, and inference answers 503."""
        http = self.config.http
        try:
            await self.http.start()
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            where = f"[{http.host}]" if ":" in http.host else http.host
            raise StartupError(f"HTTP cannot listen on {where}:{http.port}: {reason}") from None
        if self.grpc is not None:
            try:
                await self.grpc.start()
            except OSError as exc:  # it names the address
                await self.http.stop()
                raise StartupError(str(exc)) from None
        self._listening = True

    async def run(self) -> None:
        """Start, serve until SIGINT/SIGTERM, then drain and stop."""
        self._stop_requested = asyncio.Event()
        raise_open_file_limit()  # before any model or listener takes descriptors
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.reloader.on_sighup)
        try:
            await self.start()
            await self._stop_requested.wait()
        finally:
            await self.stop()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.state is ServerState.DRAINING:
            log.warning("second %s: stopping without waiting for in-flight requests", sig.name)
            raise SystemExit(1)
        log.info("%s received: draining", sig.name)
        assert self._stop_requested is not None
        self._stop_requested.set()

    async def stop(self) -> None:
        if self.state is ServerState.STOPPED:
            return
        listening = self._listening  # from the start: see _listen
        self.state = ServerState.DRAINING
        await self.reloader.stop_watching()
        if listening:
            # Each frontend closes its listeners, then waits for its in-flight
            # calls (their requests are still being batched: models stay
            # loaded until after). gRPC health turns NOT_SERVING first thing.
            stopping = [self.http.stop()]
            if self.grpc is not None:
                stopping.append(self.grpc.stop())
            await asyncio.gather(*stopping)
        await self.reloader.finish_retiring()
        await self._unload_all()
        await self.metrics.stop()
        if self._cache_releaser is not None:
            self._cache_releaser.cancel()
        self.state = ServerState.STOPPED
        await self.registration.close()
        log.info("stopped")

    def _apply_gpu_settings(self) -> None:
        """The ``"gpu"`` block, for the devices the configured models use. (A
        device first used by a model added in a reload is capped at the next start.)"""
        gpu = self.config.gpu
        if gpu.mem_limit_mib is None and gpu.empty_cache_interval_s is None:
            return
        if not gpu_present():
            log.info("gpu settings not applied: torch sees no CUDA device")
            return
        import torch

        apply_memory_limit(torch.cuda, gpu, cuda_indices(m.device for m in self.config.models))
        if gpu.empty_cache_interval_s is not None:
            releaser = CacheReleaser(torch.cuda, gpu.empty_cache_interval_s)
            self._cache_releaser = asyncio.create_task(releaser.run())

    async def _unload_all(self) -> None:
        for rt in reversed(self.registry.swap(remove=list(self.registry))):
            await rt.unload()
