"""The composition root: the server's lifecycle, starting -> ready -> draining -> stopped.

Layer ``server``, the top beside ``library``: it builds the registry, the
frontends (handing them a :class:`~aserve.frontends.context.FrontendContext`), the
metrics and the reloader, and runs on the loop.

Startup binds the listeners first, then loads and warms every model before
readiness turns true; each load is given up after its ``load_timeout_s``.
SIGINT or SIGTERM starts a graceful stop (see :meth:`Server.drain`):
readiness turns false on HTTP and gRPC, the server serves on for
``drain_grace_s``, the listeners close, every request read is answered
(bounded by ``drain_timeout_s``), then the models unload in reverse order of
loading. A signal during startup gives the loads in progress up and stops.

The signals are seen on a thread of their own (:mod:`aserve.workers.signals`),
so the stop's deadline runs from the first one even while the loop is stuck.
The stop is bounded whatever the models do (:class:`StopDeadline`): past
``drain_grace_s + drain_timeout_s +`` :data:`STOP_MARGIN_S`, and at once on a
second signal, the process kills its children and ends with status 1. It
ends with status 1 too when a thread had to be left running (a load or a
batch stuck in a model: see :mod:`aserve.workers.offload`).

While ready, the config file is watched and SIGHUP re-reads it; changes are
applied by :class:`aserve.loop.reload.Reloader` without a restart.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import os
import signal
import time
from pathlib import Path

from aserve.config import DeviceConfig, ModelConfig, ServerConfig
from aserve.engines.gpu_memory import CacheReleaser, apply_memory_limit, cuda_indices, gpu_present
from aserve.frontends.auth import ApiKeys, load_api_keys
from aserve.frontends.common import Admission, RequestMetrics
from aserve.frontends.context import FrontendContext
from aserve.frontends.grpc.server import GrpcFrontend
from aserve.frontends.http.app import CUT_OFF_S, HttpFrontend
from aserve.loop.device_scheduler import Devices
from aserve.loop.loop_lag import LoopLag
from aserve.loop.memory_budget import MemoryBudget
from aserve.loop.registry import ModelRegistry
from aserve.loop.reload import ConfigSource, Reloader
from aserve.loop.runtimes.factory import create_runtime
from aserve.obs.device_metrics import DeviceCollector
from aserve.obs.fd_limit import raise_open_file_limit
from aserve.obs.loop_stall_metrics import LoopStallCollector
from aserve.obs.memory_metrics import MemoryCollector
from aserve.obs.metrics import Metrics
from aserve.obs.registration import Listing, Registration
from aserve.workers import supervisor
from aserve.workers.last_resort import StopDeadline
from aserve.workers.signals import SignalWatch

log = logging.getLogger("aserve.server")

# What a stop may take past drain_grace_s + drain_timeout_s (the cut-off of what
# still runs, the gRPC grace, unloading every model) before the process is ended.
STOP_MARGIN_S = 30.0


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
        self.devices = Devices()  # the shared devices' schedulers
        self.api_keys: ApiKeys | None = None
        if config.auth is not None:
            try:
                self.api_keys = load_api_keys(config.auth, base_dir)
            except ValueError as exc:
                raise StartupError(str(exc)) from None
        # Every load measured; on a device with a memory budget, made room for.
        self.memory = MemoryBudget(self.registry, base_dir, config)
        self.reloader = Reloader(
            self.registry, base_dir, config, source, self._state_value, self._models_swapped,
            memory=self.memory,
        )  # fmt: skip
        # Before the frontends, which count requests in it.
        self.metrics = Metrics(
            RequestMetrics(config.logging.access_log), self.registry, self.reloader.status.counts
        )
        self.admission = Admission(config.limits.max_concurrency, self.metrics.requests.rejected)
        frontend = FrontendContext(
            config, base_dir, self.registry, self.admission, self.metrics, self.reloader,
            self.api_keys, self.not_ready_reason, self.devices, self.memory.snapshot,
        )  # fmt: skip
        self.http = HttpFrontend(frontend)
        self.grpc = GrpcFrontend(frontend) if config.grpc is not None else None
        self._stop_requested: asyncio.Event | None = None
        self._cache_releaser: asyncio.Task[None] | None = None
        self._was_ready = False
        self._owns_process = False  # run() serves in this process: see _freeze_what_startup_made
        self._signalled = False
        self.registration = Registration(self._listing)  # this server's entry for `aserve ps`
        self.stop_deadline = StopDeadline(self.registration.remove_threadsafe)

    def _state_value(self) -> str:
        return self.state.value

    async def _models_swapped(
        self, served: list[ModelConfig], devices: dict[str, DeviceConfig]
    ) -> None:
        """The reloader's hook, right after it swapped the routing table: the config
        names the models now served and every model runs on its device as the
        ``devices`` block says (before any await), then gRPC health follows."""
        self.config = self.config.model_copy(update={"models": served, "devices": devices})
        self.memory.configure(self.config)
        self._share_devices()
        if self.grpc is not None:
            await self.grpc.update_health()

    def _share_devices(self) -> None:
        """Put each routed model on its shared device's scheduler, or on none."""
        self.devices.configure(self.config.devices)
        self.devices.assign((rt.config.device, rt) for rt in self.registry)

    def not_ready_reason(self) -> str | None:
        """Why the server is not ready, or None when it is."""
        if self.state is not ServerState.READY:
            return f"server is {self.state.value}"
        # A model that loads on demand is not loaded until asked for: the server is ready without it.
        down = [rt.label for rt in self.registry if not rt.ready and not rt.loads_on_demand]
        return f"model(s) not ready: {', '.join(down)}" if down else None

    def _listing(self) -> Listing:
        """What this server's `aserve ps` entry says of it now (on the loop)."""
        return Listing(
            state=self.state.value,
            config_file=self.reloader.status.config_file,
            tls=self.config.tls is not None,
            http=self.http.addresses,
            grpc=self.grpc.addresses if self.grpc is not None else [],
            models=self.reloader.index(),
        )

    async def start(self) -> None:
        """Open the listeners, then load and warm every model; ready after that."""
        self.registry.starting = True
        await self._listen()
        await self.registration.publish()
        self._apply_gpu_settings()
        runtimes = [
            create_runtime(m, self.base_dir, self.registry, self.config.gpu, self.memory)
            for m in self.config.models
        ]
        timeouts = [self.config.load_timeout_of(rt.config) for rt in runtimes]
        with self.reloader.loading(runtimes, timeouts):
            try:
                results = await asyncio.gather(
                    *(
                        self.memory.load_within(rt, t, why="startup")
                        for rt, t in zip(runtimes, timeouts, strict=True)
                    ),
                    return_exceptions=True,
                )
            except asyncio.CancelledError:  # a signal: the loads were given up
                await asyncio.gather(*(rt.unload() for rt in runtimes), return_exceptions=True)
                raise
        await asyncio.to_thread(supervisor.stop_early)  # started early for none of them
        failed = [
            f"model '{rt.label}' failed to load: {result}"
            for rt, result in zip(runtimes, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failed:
            await asyncio.gather(*(rt.unload() for rt in runtimes), return_exceptions=True)
            raise StartupError("\n".join(failed))  # run() closes the listeners
        self.registry.swap(add=runtimes)
        self._share_devices()
        if self._owns_process:
            _freeze_what_startup_made()
        self.registry.starting = False
        self.state = ServerState.READY
        self._was_ready = True
        self.metrics.start()
        self.metrics.registry.register(LoopStallCollector(LoopLag.of_running_loop().stalls))
        self.metrics.registry.register(DeviceCollector(self.devices.snapshot))
        self.metrics.registry.register(MemoryCollector(self.memory.snapshot))
        if self.grpc is not None:
            await self.grpc.update_health()
        self.reloader.start()
        await self.registration.refresh()  # ps says ready now, not at its next look
        log.info(
            "ready: %d model(s) serving; dashboard: %s", len(self.registry), self.http.dashboard_url
        )

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
        self._owns_process = True
        raise_open_file_limit()  # before any model or listener takes descriptors
        # Seen on a thread of their own, so that a stop is bounded even while the
        # loop is stuck (see aserve.workers.signals).
        signals = SignalWatch(
            asyncio.get_running_loop(), self._on_signal, self._on_stop_signal_threadsafe
        )
        signals.start()
        try:
            await self._start_unless_stopped()
            await self._stop_requested.wait()
        finally:
            # Here, not in stop(): the process is this server's only when it runs
            # this way (a test or an application may start and stop it in its own).
            self._arm_stop_deadline_threadsafe()
            await self.stop()
            signals.stop()

    async def _start_unless_stopped(self) -> None:
        """:meth:`start`, unless a signal comes first: then the loads in progress
        are given up (their runtimes unloaded) and this returns, to stop."""
        assert self._stop_requested is not None
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not starting.done():
                log.info("stopping while the models load: their loads are given up")
                starting.cancel()
                await asyncio.wait([starting])
        if not starting.cancelled():
            starting.result()  # StartupError

    def _on_signal(self, sig: signal.Signals) -> None:
        if sig is signal.SIGHUP:
            self.reloader.on_sighup()
            return
        if self._signalled:
            return  # a second one ends the process from the signal thread
        self._signalled = True
        assert self._stop_requested is not None
        self._stop_requested.set()

    def _on_stop_signal_threadsafe(self, sig: signal.Signals, count: int) -> None:
        """The ``count``-th SIGINT/SIGTERM, on the signal thread, before the loop hears
        of it: the stop's deadline runs from the first, whatever the loop is doing."""
        if count > 1:
            # Not SystemExit: the loop's close would wait for threads that may never end.
            self.stop_deadline.exit_now(
                f"second {sig.name}: stopping without waiting for in-flight requests"
            )
        again = (
            "press Ctrl-C again to stop now" if sig is signal.SIGINT
            else f"a second {sig.name} stops now"
        )  # fmt: skip
        log.info("%s received: draining (%s)", sig.name, again)
        self._arm_stop_deadline_threadsafe()

    def _arm_stop_deadline_threadsafe(self) -> None:
        grace = self.config.drain_grace_s if self._was_ready else 0.0
        self.stop_deadline.arm(
            grace + self.config.drain_timeout_s + STOP_MARGIN_S,
            f"drain_grace_s {grace:g} + drain_timeout_s {self.config.drain_timeout_s:g} + "
            f"{STOP_MARGIN_S:g} s",
        )

    async def stop(self) -> None:
        if self.state is ServerState.STOPPED:
            return
        listening = self._listening  # from the start: see _listen
        self.state = ServerState.DRAINING  # /v2/health/ready answers 503 from here
        if listening and self.grpc is not None:
            await self.grpc.begin_drain()  # and gRPC health NOT_SERVING
        await self.reloader.stop_watching()
        if listening:
            await self.drain()
            stopping = [self.http.stop()]
            if self.grpc is not None:
                stopping.append(self.grpc.stop(CUT_OFF_S))
            await asyncio.gather(*stopping)
        await self.reloader.finish_retiring()
        await self._unload_all()
        await self.metrics.stop()
        if self._cache_releaser is not None:
            self._cache_releaser.cancel()
        self.state = ServerState.STOPPED
        await self.registration.close()
        log.info("stopped; requests answered: %s", self._answered() or "none")

    async def drain(self) -> None:
        """Leave without failing a request the server has read.

        1. (In :meth:`stop`.) Readiness turns false at once, on HTTP and gRPC
           health alike.
        2. For ``drain_grace_s`` everything is served as before, so that load
           balancers and Kubernetes endpoints take the server out of rotation
           before it stops accepting.
        3. The listeners close (gRPC sends GOAWAY); HTTP answers say
           ``Connection: close`` and idle connections close when no client can
           be sending on them (see ``aserve/frontends/http/drain.py``).
        4. Requests in flight are answered, up to ``drain_timeout_s``. Past it,
           generation streams end with a final error event and what still runs
           is cancelled ``CUT_OFF_S`` later. Models stay loaded until after.
        """
        # A server that never was ready is in no load balancer's rotation: no grace.
        grace = self.config.drain_grace_s if self._was_ready else 0.0
        if grace > 0:
            log.info("not ready; serving on for drain_grace_s (%g s)", grace)
            await asyncio.sleep(grace)
        timeout = self.config.drain_timeout_s
        await self.http.close_listeners()
        drains = [self.http.drain(timeout)]
        if self.grpc is not None:
            self.grpc.close_listeners(timeout + CUT_OFF_S)
            drains.append(self.grpc.drain(timeout))
        log.info("listeners closed; answering the requests in flight")
        if not all(await asyncio.gather(*drains)):
            log.warning(
                "requests still in flight after drain_timeout_s (%g s): generation streams "
                "end with an error, the rest is cancelled in %g s",
                timeout, CUT_OFF_S,
            )  # fmt: skip
            for rt in self.registry:
                rt.end_streams()  # each stream's route sends its error and ends

    def _answered(self) -> str:
        """The requests the frontends answered since start, by protocol and status."""
        totals: dict[tuple[str, str], int] = {}
        for (_, _, protocol, status), n in self.metrics.requests.counts.items():
            totals[protocol, status] = totals.get((protocol, status), 0) + n
        return ", ".join(f"{p} {s} {n}" for (p, s), n in sorted(totals.items()))

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
            self._cache_releaser = asyncio.create_task(_release_periodically(releaser))

    async def _unload_all(self) -> None:
        for rt in reversed(self.registry.swap(remove=list(self.registry))):
            await rt.unload()


def _freeze_what_startup_made() -> None:
    """Collect once, then move every object alive into the collector's permanent
    generation (``gc.freeze``), before the server is ready.

    torch, the frontends and the models leave a few hundred thousand objects
    that live as long as the process; each full collection walks them all,
    holding the GIL for 60 to 140 ms (measured on CPU beside the models of
    ``bench/memory_budget.py``), a stall of every request and batch a few
    times a minute under load. Frozen, a full collection walks only what came
    after. Only a server that owns its process (``run``) does this: in an
    application's own process the objects are the application's.
    """
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "%d objects frozen out of the collector's walks (%.0f ms)",
        gc.get_freeze_count(), (time.perf_counter() - t0) * 1e3,
    )  # fmt: skip


async def _release_periodically(releaser: CacheReleaser) -> None:
    """``gpu.empty_cache_interval_s``: the release itself on a worker thread,
    since ``empty_cache`` waits for the device."""
    while True:
        await asyncio.sleep(releaser.interval_s)
        await asyncio.to_thread(releaser.release)
