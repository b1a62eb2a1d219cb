"""Each device's memory budget: every load measured, loads serialized, idle models evicted.

Layer: loop; runs on the event loop (the readings of :mod:`aserve.engines.footprint`
are quick system calls; what touches the disk or walks the heap runs off it).

Every model load goes through :meth:`MemoryBudget.load_within`, at startup,
in a reload and at an on-demand model's first request, and is measured: its
footprint (what the device's memory grew by, see
:mod:`aserve.engines.footprint`; never less than its weights' files) and its
load time are kept per model version
(:class:`~aserve.loop.device_memory.ModelMemory`), across the fresh runtimes
of its later loads.

On a device with a ``memory_budget_mib``, loads are serialized (one at a
time, so each measure is the model's own; each device has its own lock, so
a long load holds up no other device), and before one the device makes
room: if the model's footprint (measured at its last load; before its first,
for an on-demand model :func:`aserve.sched.eviction.estimate_footprint_mib`
of its files, on the high side, and for one loaded at startup or by a
reload its files' size) does not fit beside what the loaded models hold,
idle on-demand models are unloaded, in the order of the device's
``eviction`` rule (:func:`aserve.sched.eviction.make_room`: by default the
one whose eviction costs least first, its recent request rate times its
mean load time; or least recently used first), never a resident or pinned
one, never one with requests queued, running or waiting for it (under
``cost``, a load waits up to its own expected time for a busy model that
would be cheaper to evict than the idle ones to go idle). When even that
cannot make room the load fails, saying what holds the memory. A load whose
measured footprint turns out larger than assumed makes room again after it,
or is unloaded and fails: what the loaded models hold, as measured, never
adds up to more than the budget once a load is over. Models loaded at
startup (``"load": "startup"``) count against the budget and are never
evicted.

On a device without a budget, loads are not serialized. A footprint measured
while another load ran (on the same device; for a measure of the process's
resident set, on any device) is marked ``overlapped``: it may hold some of
the other's, and is kept as measured (too high, it makes more room than
needed; the next load measures again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aserve.config import DeviceConfig, ModelConfig, ServerConfig
from aserve.engines import builtin
from aserve.engines.footprint import (
    children_rss_bytes,
    cuda_allocated_bytes,
    files_bytes,
    import_engine_libraries,
    rss_bytes,
)
from aserve.engines.heap import map_large_blocks, release_freed_memory
from aserve.loop.device_memory import DeviceMemory, Held, LoadCount, ModelMemory, OnDemand
from aserve.loop.registry import ModelRegistry
from aserve.loop.runtimes.base import Runtime
from aserve.sched.eviction import MIB, make_room, worth_waiting
from aserve.sched.eviction import Held as Candidate
from aserve.workers.offload import run_off_loop

log = logging.getLogger("aserve.memory")

# On a device of the process's own memory with a budget, blocks from this size
# up are mapped on their own (aserve.engines.heap.map_large_blocks): a model's
# weights leave the process's RSS with it. A weight below it is small enough
# that what models of other sizes leave behind between them stays small.
MAP_LARGE_BLOCKS_BYTES = 4 * MIB
# Engines whose weights are their files, read into memory whole: a footprint
# is never taken as less than the files' size (an RSS reading that reused
# memory freed just before would be).
WEIGHT_FILE_ENGINES = ("torch", "onnx", "tensorrt")


class NoRoom(RuntimeError):
    """A load that does not fit in its device's memory budget, even with every
    model that may leave unloaded; the message says what holds the memory.
    ``loaded``: found once the model was loaded (measured), not before."""

    def __init__(self, message: str, loaded: bool = False) -> None:
        super().__init__(message)
        self.loaded = loaded


class MemoryBudget:
    """The server's devices' memory: measured loads, budgets, eviction.

    ``registry`` is the routing table (a model's state for ``/metrics``);
    :meth:`configure` is handed each config that comes into force.
    """

    def __init__(self, registry: ModelRegistry, base_dir: Path, config: ServerConfig) -> None:
        self._registry = registry
        self._base_dir = base_dir
        self._devices: dict[str, DeviceMemory] = {}
        self._records: dict[tuple[str, str], ModelMemory] = {}
        self._process = LoadCount()  # every device's loads' measures
        self._mapped = False  # large blocks mapped on their own (see configure)
        self._config = config
        self.configure(config)

    def configure(self, config: ServerConfig) -> None:
        """Take the budgets and eviction rules of ``config``'s ``devices`` block (a
        reload's, in place: a lower budget is made room for at the next load on
        the device)."""
        self._config = config
        for name, dev in self._devices.items():
            entry = config.devices.get(name)
            dev.budget_mib = entry.memory_budget_mib if entry is not None else None
            dev.eviction = entry.eviction if entry is not None else "cost"
            dev.park = _parks(name, entry)
        for name in config.devices:
            self.device(name)
        budgeted = [d for d in self._devices.values() if d.budget_mib is not None]
        if not self._mapped and any(not d.name.startswith("cuda") for d in budgeted):
            self._mapped = map_large_blocks(MAP_LARGE_BLOCKS_BYTES)

    def device(self, name: str) -> DeviceMemory:
        dev = self._devices.get(name)
        if dev is None:
            entry = self._config.devices.get(name)
            budget = entry.memory_budget_mib if entry is not None else None
            eviction = entry.eviction if entry is not None else "cost"
            dev = self._devices[name] = DeviceMemory(name, budget, eviction)
            dev.park = _parks(name, entry)
        return dev

    def record(self, config: ModelConfig) -> ModelMemory:
        rec = self._records.get(config.key)
        if rec is None:
            rec = self._records[config.key] = ModelMemory(f"{config.name}/{config.version}", "")
        rec.device = config.device
        return rec

    def load_timeout_of(self, config: ModelConfig) -> float:
        return self._config.load_timeout_of(config)

    def ready_at(self, config: ModelConfig, runtime: Runtime | None) -> float:
        """When ``runtime``'s load (None: one about to start) is expected to be over
        (``time.monotonic()``): after the loads ahead of it on a budgeted device."""
        rec = self.record(config)
        return self.device(config.device).ready_at(runtime, rec.expected_load_s(), time.monotonic())

    async def size_files(self, config: ModelConfig) -> ModelMemory:
        """Size ``config``'s files (off the loop) for the estimates before its first
        load, and import its engine's libraries (so no footprint holds them)."""
        rec = self.record(config)
        if rec.file_bytes is None:
            rec.file_bytes = await run_off_loop(
                f"sizing the files of model '{rec.label}'", self._size, config
            )
        return rec

    def _size(self, config: ModelConfig) -> int:
        """Blocking: runs off the loop."""
        import_engine_libraries(config.engine)
        if config.path is None:
            return 0
        try:
            path = builtin.locate(config.path, config.folder(self._base_dir))
        except (OSError, ValueError):
            return 0  # the load says what is wrong with it
        return files_bytes(path)

    # --- loads -----------------------------------------------------------------

    async def load_within(
        self, runtime: Runtime, timeout_s: float, owner: OnDemand | None = None, why: str = ""
    ) -> None:
        """Load ``runtime`` within ``timeout_s`` (:meth:`Runtime.load_within`),
        measured; on a budgeted device one load at a time, after making room.

        ``owner`` is the on-demand model the runtime is a fresh load of (None: a
        model loaded at startup or by a reload, never evicted). Raises what the
        load raised, or :class:`NoRoom`; a runtime that failed is the caller's
        to unload, as after any failed load. Cancelled while it waits for the
        device, nothing was loaded.
        """
        if runtime.loads_on_demand:  # a proxy: its own loads come back here
            await runtime.load_within(timeout_s)
            return
        config = runtime.config
        dev = self.device(config.device)
        rec = self.record(config)
        dev.enqueue(runtime, rec.expected_load_s())
        try:
            await self.size_files(config)
            dev.expect(runtime, rec.expected_load_s())
            if dev.budget_mib is None:
                dev.begin(runtime, time.monotonic())
                self._loaded(dev, runtime, rec, owner, why, *await self._measured(
                    dev, runtime, rec, timeout_s, why
                ))  # fmt: skip
                return
            async with dev.lock:
                dev.begin(runtime, time.monotonic())
                await self._budgeted(dev, runtime, rec, timeout_s, owner, why)
        finally:
            dev.dequeue(runtime)

    async def _budgeted(
        self,
        dev: DeviceMemory,
        runtime: Runtime,
        rec: ModelMemory,
        timeout_s: float,
        owner: OnDemand | None,
        why: str,
    ) -> None:
        """Make room, load, measure, and make room again if it measured above what
        was assumed (under the device's lock)."""
        assert dev.budget_mib is not None
        # A model that is never evicted (loaded at startup, or by a reload) is assumed
        # to need its measured footprint, else its files: the estimate's margin
        # would refuse a config of them that fits, and the check after the load
        # holds the budget all the same. An on-demand one, the estimate: its loads
        # come while serving, and the budget is to hold while it loads too.
        assumed = rec.need_mib() if owner is not None else rec.floor_mib()
        # A parked runtime holds its rest already: its load needs the weights alone.
        kept = dev.held_mib(runtime)
        assumed = max(0.0, assumed - kept)
        try:
            await self._make_room(dev, assumed, rec.label, runtime)
        except NoRoom as exc:
            # An estimate that cannot fit where the files can: tried on the files'
            # size, its measure once loaded deciding (as for a startup model).
            floor = max(0.0, rec.floor_mib() - kept)
            try:
                if floor >= assumed:
                    raise
                await self._make_room(dev, floor, rec.label, runtime)
            except NoRoom:
                rec.loads["failed"] += 1
                rec.last_error = str(exc)
                log.warning("model %s cannot load on %s%s: %s", rec.label, dev.name, _why(why), exc)
                raise exc from None
            assumed = floor
        footprint, method, load_s, overlapped = await self._measured(
            dev, runtime, rec, timeout_s, why
        )
        footprint += kept
        # Held before the check: the room made next must count it.
        dev.hold(Held(runtime, footprint, owner, rec))
        if dev.used_mib() > dev.budget_mib:
            try:
                await self._make_room(dev, 0.0, rec.label, runtime)
            except NoRoom as exc:
                dev.forget(runtime)
                rec.footprint_mib, rec.method = footprint, method  # the next load needs it
                rec.loads["failed"] += 1
                rec.last_error = (
                    f"measured at {footprint:.1f} MiB once loaded, more than the "
                    f"{assumed:.1f} MiB assumed: {exc}"
                )
                log.warning(
                    "model %s loaded on %s but does not fit, unloaded: %s",
                    rec.label, dev.name, rec.last_error,
                )  # fmt: skip
                raise NoRoom(rec.last_error, loaded=True) from None
        self._loaded(dev, runtime, rec, owner, why, footprint, method, load_s, overlapped)

    async def _measured(
        self, dev: DeviceMemory, runtime: Runtime, rec: ModelMemory, timeout_s: float, why: str
    ) -> tuple[float, str, float, bool]:
        """Load ``runtime``; its footprint in MiB, how measured, the load's time in
        seconds, and whether another load on the device overlapped it."""
        config = runtime.config
        # The process's resident set grows with any load in it (a CUDA model's
        # too); the CUDA allocator's count, with its device's alone.
        rss = not config.device.startswith("cuda")
        with dev.count.measuring() as on_device, self._process.measuring() as in_process:
            if rss:
                # What the process freed before (an evicted model, say) back to the
                # system first: else the load reuses it and its RSS barely grows.
                await run_off_loop("returning freed memory before a load", release_freed_memory)
            before = _reading(config)
            t0 = time.monotonic()
            try:
                await runtime.load_within(timeout_s)
            except asyncio.CancelledError:
                rec.loads["cancelled"] += 1
                raise
            except BaseException as exc:
                rec.loads["failed"] += 1
                rec.last_error = str(exc) or type(exc).__name__
                log.warning(
                    "model %s failed to load on %s%s: %s", rec.label, dev.name, _why(why),
                    rec.last_error,
                )  # fmt: skip
                raise
            load_s = time.monotonic() - t0
            after = _reading(config)
        footprint, method = _footprint(config, runtime, before, after, rec.file_bytes or 0)
        return footprint, method, load_s, on_device() or (rss and in_process())

    def _loaded(
        self,
        dev: DeviceMemory,
        runtime: Runtime,
        rec: ModelMemory,
        owner: OnDemand | None,
        why: str,
        footprint: float,
        method: str,
        load_s: float,
        overlapped: bool,
    ) -> None:
        """Record a load that stays: held on the device, its measures kept, logged."""
        dev.hold(Held(runtime, footprint, owner, rec))
        rec.footprint_mib, rec.method, rec.overlapped = footprint, method, overlapped
        rec.load_s = load_s
        rec.loads["ok"] += 1
        rec.restores += runtime.restored
        if not runtime.restored:
            rec.full_s = load_s
        rec.last_error = None
        rec.load_seconds.observe(load_s)
        runtime.stats.memory = rec.doc()
        budget = f"of {dev.budget_mib} MiB" if dev.budget_mib is not None else "(no budget)"
        log.info(
            "model %s loaded on %s in %.3f s%s: footprint %.1f MiB (%s%s); %s holds %.1f MiB %s",
            rec.label, dev.name, load_s, _why(why), footprint, method,
            ", overlapped another load" if overlapped else "", dev.name, dev.used_mib(), budget,
        )  # fmt: skip

    async def _make_room(
        self, dev: DeviceMemory, need_mib: float, label: str, loading: Runtime
    ) -> None:
        """Unload idle on-demand models of ``dev``, in the order of its eviction
        rule, until ``need_mib`` fits in its budget; :class:`NoRoom` when it
        cannot. ``loading`` (the runtime being loaded, held already when the room
        is made after its load) is never one of them."""
        assert dev.budget_mib is not None
        waited = False
        while True:
            entries = dev.entries()
            now = time.monotonic()
            # Each by its index: two runtimes of one model may be held (a reload's).
            candidates = [
                Candidate(
                    str(i), e.footprint_mib,
                    e.owner.last_used if e.owner is not None else 0.0,
                    resident=e.owner is None or e.owner.resident,
                    busy=e.runtime is loading or (
                        e.owner.busy if e.owner is not None else e.runtime.busy
                    ),
                    rate_per_s=e.record.requests.per_s(now),
                    # A full load's time, even where a restore would be quicker: a
                    # request for an evicted model waits for the loads queued ahead
                    # of its own too, and priced at a cheap restore, the hot models
                    # were evicted and restored over and over (bench/memory_budget.py:
                    # the second hottest's own loads went from 7 to 120 in 120 s,
                    # its p99 from 9x to 73x a server serving only the hot three).
                    load_s=e.record.full_load_s(),
                )
                for i, e in enumerate(entries)
            ]  # fmt: skip
            room = make_room(candidates, need_mib, dev.budget_mib, dev.eviction)
            if room.fits and not room.evict:
                return
            if dev.eviction == "cost" and not waited:
                waited = True
                if await self._wait_for_cheaper(dev, entries, candidates, need_mib, label, loading):
                    continue  # the state read again: choose anew
            if not room.fits:
                raise NoRoom(_no_room(dev, need_mib, label, entries, loading))
            # No await between the choice (idle, by the state just read) and the
            # victim's detaching (in evict, before its first await): a request that
            # comes next finds it unloaded and waits for a load of its own.
            index = int(room.evict[0])
            victim, chosen = entries[index], candidates[index]
            assert victim.owner is not None
            why = (
                f"costs least to evict: {chosen.rate_per_s:.3f} requests/s x "
                f"{chosen.load_s:.3f} s load"
                if dev.eviction == "cost"
                else "least recently used"
            )
            log.info(
                "evicting model %s from %s (%s; idle %.1f s, %.1f MiB) to make room for "
                "model %s (needs %.1f MiB; %.1f of %d MiB held)",
                victim.record.label, dev.name, why, now - chosen.last_used,
                victim.footprint_mib, label, need_mib, dev.used_mib(), dev.budget_mib,
            )  # fmt: skip
            victim.record.evictions += 1
            dev.forget(victim.runtime)
            released = await victim.owner.evict(f"to make room for model '{label}'", dev.park)
            if not dev.name.startswith("cuda"):
                await run_off_loop("returning an evicted model's memory", release_freed_memory)
            if released is not None:
                self._parked(dev, victim, released)

    def _parked(self, dev: DeviceMemory, victim: Held, released: int) -> None:
        """Hold what a parked model still holds: its footprint as its load measured
        it, less the weights it released (its compiled module, its instance
        thread, its share of the load's measure: about a MiB for a small MLP on
        the CPU). Evicted again, it is unloaded."""
        rest = max(0.0, victim.footprint_mib - released / MIB)
        dev.hold(replace(victim, footprint_mib=rest, parked=True))
        log.info(
            "model %s parked on %s: %.1f MiB of weights released, %.1f MiB kept "
            "(its module, for a load that reads the weights back)",
            victim.record.label, dev.name, released / MIB, rest,
        )  # fmt: skip

    async def _wait_for_cheaper(
        self,
        dev: DeviceMemory,
        entries: list[Held],
        candidates: list[Candidate],
        need_mib: float,
        label: str,
        loading: Runtime,
    ) -> bool:
        """Wait, up to the load's own expected time, for the busy models that would
        be cheaper to evict than the idle ones to go idle
        (:func:`aserve.sched.eviction.worth_waiting`); whether it waited. A model
        loaded for one request is typically still answering it when the next
        load makes room: evicting a hot one instead costs that one a load."""
        assert dev.budget_mib is not None
        waitable = {
            c.label for c, e in zip(candidates, entries, strict=True)
            if e.owner is not None and e.runtime is not loading
        }  # fmt: skip
        wait = worth_waiting(candidates, need_mib, dev.budget_mib, waitable)
        if not wait:
            return False
        owners = [entries[int(i)].owner for i in wait]
        limit = self.record(loading.config).expected_load_s()
        log.info(
            "model %s waits up to %.3f s for %s to go idle (busy, cheaper to evict) before "
            "making room on %s",
            label, limit, ", ".join(entries[int(i)].record.label for i in wait), dev.name,
        )  # fmt: skip
        await asyncio.gather(*(o.until_idle(limit) for o in owners if o is not None))
        return True

    # --- what is reported ------------------------------------------------------

    def memory_of(self, config: ModelConfig) -> dict[str, Any] | None:
        rec = self._records.get(config.key)
        return None if rec is None else rec.doc()

    def snapshot(self) -> dict[str, Any]:
        """Each device's budget and what is held, each model's loads (for ``/metrics``
        and the dashboard)."""
        served = {(rt.name, rt.version): rt for rt in self._registry}
        devices = [
            {"name": d.name, "budget_mib": d.budget_mib, "used_mib": d.used_mib()}
            for d in self._devices.values()
        ]
        models = []
        for key, rec in sorted(self._records.items()):
            rt = served.get(key)
            models.append({
                "name": key[0], "version": key[1], "device": rec.device,
                "state": rt.state.value if rt is not None else "UNAVAILABLE",
                "footprint_mib": rec.footprint_mib, "method": rec.method,
                "loads": dict(rec.loads), "evictions": rec.evictions, "restores": rec.restores,
                "load_seconds": rec.load_seconds,
            })  # fmt: skip
        return {"devices": devices, "models": models}


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def _parks(name: str, entry: DeviceConfig | None) -> bool:
    """Whether the device parks its evicted models (``park_evicted``; by default
    on CUDA devices only)."""
    if entry is not None and entry.park_evicted is not None:
        return entry.park_evicted
    return name.startswith("cuda")


def _reading(config: ModelConfig) -> int | None:
    """What the footprint's measure reads now (bytes), for the model's kind of load."""
    if config.executor == "process" or config.engine == "decoder":
        return None  # read after the load, in its children
    if config.device.startswith("cuda"):
        return cuda_allocated_bytes(config.device)
    return rss_bytes()


def _footprint(
    config: ModelConfig, runtime: Runtime, before: int | None, after: int | None, files: int
) -> tuple[float, str]:
    """The footprint in MiB and how it was measured (see aserve.engines.footprint);
    never less than the weights' files (then ``file_size``)."""
    floor = files if config.engine in WEIGHT_FILE_ENGINES else 0
    pids = runtime.worker_pids
    measured: int | None = None
    method = "file_size"
    if pids and not config.device.startswith("cuda"):
        measured, method = children_rss_bytes(pids), "children_rss"
    elif before is not None and after is not None and not pids:
        measured = max(0, after - before)
        method = "cuda_allocator" if config.device.startswith("cuda") else "rss"
    if measured is None or measured < floor:
        return max(floor, files) / MIB, "file_size"
    return measured / MIB, method


def _no_room(
    dev: DeviceMemory, need_mib: float, label: str, entries: list[Held], loading: Runtime
) -> str:
    parts = []
    for e in entries:
        why = (
            "this load" if e.runtime is loading
            else "loaded at startup" if e.owner is None
            else "resident" if e.owner.resident
            else "busy" if e.owner.busy
            else "idle"
        )  # fmt: skip
        parts.append(f"{e.record.label} {e.footprint_mib:.1f} MiB ({why})")
    held = "; ".join(parts) or "nothing"
    if need_mib == 0:  # after the load: itself among what is held
        used = sum(e.footprint_mib for e in entries)
        return (
            f"the models on {dev.name} hold {used:.1f} MiB, more than its memory_budget_mib "
            f"{dev.budget_mib}, and none can be unloaded now: {held}"
        )
    return (
        f"model '{label}' needs {need_mib:.1f} MiB on {dev.name}, which does not fit in its "
        f"memory_budget_mib {dev.budget_mib} beside what cannot be unloaded now: {held}"
    )
