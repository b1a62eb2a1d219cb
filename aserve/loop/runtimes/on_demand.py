"""A model loaded at its first request, and unloaded when its device needs the room.

Layer: loop; runs on the event loop. An :class:`OnDemandRuntime` is what the
routing table holds for a model with ``"load": "on_demand"``: it is routed
from the start, as every model is, but holds no engine until a request comes.
Each load makes a fresh runtime of the model's engine (``fresh``, the
factory's), loaded by :class:`aserve.loop.memory_budget.MemoryBudget` (measured,
and on a budgeted device after making room); each eviction unloads it and
forgets it. Its statistics are one :class:`~aserve.obs.stats.ModelStats`
across its loads.

A request that finds it unloaded starts its load, or joins the load in
progress (concurrent requests share one), and waits for it within its own
deadline; while it waits it counts as the model's (the model is busy, so
never evicted). It is refused at once (503) when the load cannot be over
before its deadline: the load's expected time is its last measured one, or
an estimate from its files' size before its first load
(:func:`aserve.sched.eviction.estimate_load_s`), after the loads ahead of
it on its device; the load goes on for the requests that come later. A load
that fails fails every request waiting for it with the reason; for
:data:`FAILED_HOLD_S` after, requests are refused with it at once, then the
next one tries again (a load refused for want of room before it began is
tried again at the next request: that cost nothing).

It takes requests whether loaded or not (:meth:`OnDemandRuntime.not_ready_reason`
is None unless it is unloaded, failed just now, or its loaded engine cannot
serve): a client that waits for a model to be ready before it sends would
otherwise wait for good. The repository index says whether it is loaded:
``READY``, or ``UNAVAILABLE`` with the reason ``not loaded: ...`` (never
loaded yet), ``loading: ...``, ``evicted: ...``, ``failed: ...`` or
``unloaded``. ``resident`` (the config's, or :meth:`OnDemandRuntime.pin`, an
explicit repository load) keeps it loaded once loaded. Each request, loaded
or not, is noted in its version's request rate
(:class:`~aserve.sched.eviction.RequestRate`), which the device's ``cost``
eviction rule weighs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from aserve.config import GpuConfig, ModelConfig
from aserve.errors import DeadlineExceeded, Unavailable
from aserve.loop.memory_budget import MemoryBudget, NoRoom
from aserve.loop.runtimes.base import ModelState, Runtime, batching_reconfigurable, not_ready

if TYPE_CHECKING:
    from aserve.loop.device_scheduler import DeviceScheduler
    from aserve.obs.handler_metrics import MetricSet

log = logging.getLogger("aserve.model")

# After a failed load, how long requests are refused with its reason before
# one tries again: a broken file must not turn every request into a load.
FAILED_HOLD_S = 5.0


class OnDemandRuntime(Runtime):
    """The runtime of an on-demand model: loads through ``memory``; ``fresh(config)``
    makes a runtime of its engine, not loaded."""

    def __init__(
        self,
        config: ModelConfig,
        base_dir: Path,
        gpu: GpuConfig | None,
        fresh: Callable[[ModelConfig], Runtime],
        memory: MemoryBudget,
    ) -> None:
        super().__init__(config, base_dir, gpu)
        self._fresh = fresh
        self._memory = memory
        # Its version's loads and memory, and its request rate (kept across the
        # runtimes of a reload): what evicting it would cost.
        self._record = memory.record(config)
        self._shape = fresh(config)  # never loaded: its specs and metadata, from the config
        self._serve_specs(self._shape)
        self.state = ModelState.UNAVAILABLE
        self.why = "not loaded: it loads at its first request"
        self.last_used = 0.0
        self.pinned = False  # an explicit repository load: resident until unloaded
        self._leaving = False  # being replaced by a reload: may make room for its successor
        self._inner: Runtime | None = None  # the loaded runtime
        self._parked: Runtime | None = None  # evicted, its weights released (Runtime.park)
        self._loading: Runtime | None = None  # the runtime its load in progress loads
        self._load: asyncio.Task[Runtime] | None = None
        self._failed_at: float | None = None
        self._active = 0  # requests inside infer: waiting for the load, queued or running
        self._idle = asyncio.Event()  # set while _active is 0
        self._idle.set()
        self._waiting = 0  # of those, the ones waiting for the load
        self._closed = False  # unloaded by its owner (a reload, the stop): loads no more
        self._device: DeviceScheduler | None = None

    def _serve_specs(self, runtime: Runtime) -> None:
        """Check requests against what ``runtime`` serves (the loaded one's, once loaded)."""
        self.input_specs = runtime.input_specs
        self.output_specs = runtime.output_specs
        self.max_batch_size = runtime.max_batch_size
        self.variable_shapes = runtime.variable_shapes

    # --- the contract -----------------------------------------------------------

    @property
    def loads_on_demand(self) -> bool:
        return True

    @property
    def resident(self) -> bool:
        """Never unloaded to make room (the config's ``resident``, or pinned), unless
        a reload replaces it: then its successor may take its room."""
        return (self.config.resident or self.pinned) and not self._leaving

    def pin(self) -> None:
        """Keep it loaded once loaded, until it is unloaded (an explicit load)."""
        self.pinned = True

    def unpin(self) -> None:
        self.pinned = False

    def leaving(self, leaving: bool) -> None:
        """A reload is loading its successor (True), or gave up (False)."""
        self._leaving = leaving

    def not_ready_reason(self) -> str | None:
        """None while it takes requests, loaded or not (a request loads it)."""
        if self._closed:
            return not_ready(self.label, "unloaded")
        inner = self._inner
        if inner is not None:
            return inner.not_ready_reason()
        if self._load is None and self._failed_hold(time.monotonic()) is not None:
            return not_ready(self.label, self.why)
        return None

    def repository_state(self) -> tuple[str, str]:
        """Its state and reason for the repository index."""
        if self._inner is not None and self.state is ModelState.READY:
            why = self._inner.not_ready_reason()
            return ("READY", "") if why is None else ("UNAVAILABLE", why)
        if self._load is not None:
            left = max(0.0, self._memory.ready_at(self.config, self._loading) - time.monotonic())
            return "UNAVAILABLE", f"loading: expected ready in about {left:.1f} s"
        return "UNAVAILABLE", self.why

    @property
    def busy(self) -> bool:
        inner = self._inner
        return self._active > 0 or (inner is not None and inner.busy)

    async def until_idle(self, timeout_s: float) -> bool:
        """Wait until no request is inside it, at most ``timeout_s``; whether it is
        idle then (the budget waits so for a model cheaper to evict). Cancelled,
        it stops waiting."""
        if self._active:
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11
                await asyncio.wait_for(self._idle.wait(), timeout_s)
        return not self.busy

    @property
    def worker_pids(self) -> list[int]:
        return self._inner.worker_pids if self._inner is not None else []

    @property
    def handler_metrics(self) -> MetricSet | None:
        return self._inner.handler_metrics if self._inner is not None else None

    @staticmethod
    def reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
        """In place: ``resident`` and what the engine's runtime applies in place
        (batching but ``max_batch_size``, ``load_timeout_s``); else a new runtime."""
        return batching_reconfigurable(old.model_copy(update={"resident": new.resident}), new)

    def reconfigure(self, config: ModelConfig) -> None:
        super().reconfigure(config)
        for inner in (self._inner, self._parked):
            if inner is not None:  # its config keeps its own "resident", which it never reads
                inner.reconfigure(config.model_copy(update={"resident": inner.config.resident}))

    def share(self, device: DeviceScheduler | None) -> None:
        self._device = device
        if self._inner is not None:
            self._inner.share(device)

    async def load(self) -> None:
        """At startup or in a reload: size its files (the estimates before its
        first load); pinned (an explicit repository load), load it now."""
        await self._memory.size_files(self.config)
        if self.pinned:
            self._start_load("an explicit load")
            assert self._load is not None
            await self._load

    async def load_pinned(self) -> None:
        """An explicit load of the routed runtime: pinned, and loaded now if it is
        not (joining a load in progress); raises what its load raised. Cancelled,
        the load goes on (a request may share it)."""
        self.pin()
        if self._closed:
            raise Unavailable(not_ready(self.label, "unloaded"))
        if self._inner is not None:
            return
        if self._load is None:
            self._start_load("an explicit load")
        load = self._load
        assert load is not None
        await asyncio.wait([load])
        if load.cancelled():
            raise Unavailable(not_ready(self.label, self.why))
        load.result()

    async def _stop(self) -> None:
        self._closed = True
        self.why = "unloaded"
        load = self._load
        if load is not None:
            load.cancel()
            await asyncio.wait([load])
        inner, self._inner = self._inner, None
        parked, self._parked = self._parked, None
        for runtime in (inner, parked):
            if runtime is not None:
                await runtime.unload()

    # --- loading and eviction ---------------------------------------------------

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> dict[str, np.ndarray]:
        """As :meth:`Runtime.infer`; not loaded, the request loads it first (or
        joins its load) within its deadline, counted from ``arrival``."""
        self._active += 1
        self._idle.clear()
        self.last_used = now = time.monotonic()
        self._record.requests.note(now)
        try:
            inner = self._inner
            if inner is None:
                inner = await self._loaded(timeout_s, arrival)
            return await inner.infer(
                inputs, batch_size, shape_key, timeout_s, client_id, parameters, arrival=arrival
            )
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
            self.last_used = time.monotonic()

    def _failed_hold(self, now: float) -> float | None:
        """Seconds left of the hold after a failed load, or None when there is none."""
        if self._failed_at is None or now >= self._failed_at + FAILED_HOLD_S:
            return None
        return self._failed_at + FAILED_HOLD_S - now

    async def _loaded(self, timeout_s: float, arrival: float | None) -> Runtime:
        """The loaded runtime, within the request's deadline: its load started or
        joined; refused at once when it cannot be over in time."""
        now = time.monotonic()
        deadline = (arrival if arrival is not None else now) + timeout_s
        if self._closed:
            raise Unavailable(not_ready(self.label, "unloaded"))
        hold = self._failed_hold(now)
        if hold is not None and self._load is None:
            raise Unavailable(
                f"{not_ready(self.label, self.why)}; its load is tried again at a request "
                f"in {hold:.1f} s"
            )
        if self._load is None:
            self._start_load("a request")
        load = self._load
        assert load is not None
        ready_at = self._memory.ready_at(self.config, self._loading)
        if ready_at > deadline:
            wall = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
                seconds=ready_at - now
            )
            raise Unavailable(
                f"model '{self.label}' is loading: ready in about {max(0.0, ready_at - now):.2f} s "
                f"(at {wall.isoformat(timespec='milliseconds')}), after the request's deadline "
                f"in {max(0.0, deadline - now):.2f} s; try again then, or with a longer timeout"
            )
        # asyncio.wait, not the task itself: a load cancelled (the model unloaded)
        # is this request's error, not its cancellation.
        self._waiting += 1
        try:
            done, _ = await asyncio.wait([load], timeout=max(0.0, deadline - now))
        finally:
            self._waiting -= 1
        if not done:
            raise DeadlineExceeded(
                f"model '{self.label}' was still loading at the request's deadline "
                f"({timeout_s:g} s)"
            )
        if load.cancelled():
            raise Unavailable(not_ready(self.label, self.why))
        error = load.exception()
        if error is not None:
            raise Unavailable(f"model '{self.label}' failed to load: {error}")
        return load.result()

    def _start_load(self, why: str) -> None:
        self.state = ModelState.LOADING
        # A parked runtime reads its weights back (its load falls back to a fresh
        # one when it cannot); else a new runtime of the engine.
        inner, self._parked = self._parked or self._fresh(self.config), None
        self._loading = inner
        inner.use_stats(self.stats)  # one set of statistics across its loads
        task = asyncio.create_task(self._run_load(inner, why), name=f"aserve-load-{self.label}")
        task.add_done_callback(_retrieved)
        self._load = task

    async def _run_load(self, inner: Runtime, why: str) -> Runtime:
        try:
            await self._memory.load_within(
                inner, self._memory.load_timeout_of(self.config), owner=self, why=why
            )
        except BaseException as exc:
            self.state = ModelState.UNAVAILABLE
            if isinstance(exc, asyncio.CancelledError):
                self.why = "unloaded" if self._closed else "not loaded: its load was given up"
            else:
                self.why = f"failed: {exc}"
                # No room before the load cost nothing: the next request asks again
                # (a busy model may be idle by then). A load that ran and failed waits.
                if not (isinstance(exc, NoRoom) and not exc.loaded):
                    self._failed_at = time.monotonic()
            self._load = self._loading = None
            await inner.unload()
            raise
        self._failed_at = None
        self._serve_specs(inner)
        self._inner = inner
        inner.share(self._device)
        self.state = ModelState.READY
        self.why = ""
        self._load = self._loading = None
        return inner

    async def evict(self, reason: str, park: bool = False) -> int | None:
        """Make room (the budget chose it: idle): with ``park``, park the loaded
        runtime where it can (its weights released, its compiled module,
        instances and latency estimates kept: the next load reads the weights
        back), else unload it;
        the bytes a park released, None when it unloaded. Evicted while parked,
        the parked runtime is unloaded.

        Detached before the first await: a request that comes meanwhile starts
        a load, which waits for the device's lock this eviction holds."""
        inner, self._inner = self._inner, None
        self.state = ModelState.UNAVAILABLE
        self.why = f"evicted: {reason}"
        if inner is None:
            parked, self._parked = self._parked, None
            if parked is not None:
                await parked.unload()
            return None
        released = await inner.park() if park else None
        if released is None:
            await inner.unload()
            return None
        self._parked = inner
        return released

    # --- what is reported -------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return (self._inner or self._shape).metadata()

    def triton_config(self) -> dict[str, Any]:
        return (self._inner or self._shape).triton_config()

    def statistics(self) -> dict[str, Any]:
        if self._inner is not None:
            doc = self._inner.statistics()
        else:
            doc = self.stats.as_dict(0, 0)
        state, reason = self.repository_state()
        doc["memory"] = {
            "state": state, "reason": reason, "resident": self.resident,
            "waiting_for_load": self._waiting,
            "requests_per_s": round(self._record.requests.per_s(time.monotonic()), 4),
            **(self._memory.memory_of(self.config) or {}),
        }  # fmt: skip
        return doc


def _retrieved(task: asyncio.Task[Runtime]) -> None:
    """A load's error is its waiters' (or nobody's, when none waits): not logged
    again as never retrieved."""
    if not task.cancelled():
        task.exception()
