"""Config hot reload and the model repository: change what is served while serving.

Layer: loop. Runs on the loop; reading, parsing, importing handlers and
loading models run off it. Runtimes are seen through their one contract
(:class:`aserve.loop.runtimes.base.Runtime`). One change is applied at a
time (a lock), whatever asked for it: the file watcher, SIGHUP, or the
repository API (load/unload).

A change goes: read the file -> parse and validate into a new immutable
config (handlers imported, files checked) -> diff against what is served ->
load and warm every added or changed model beside the running ones -> swap
the routing table in one assignment -> drain the runtimes that left it and
unload them in the background. What applies in place, without a new
runtime, the runtime's class says (``reconfigurable``): batching settings
other than ``max_batch_size``; for a decoder model, nothing. Anything that fails
before the swap changes nothing: the new runtimes are unloaded, the old
config stays in force, and the error (with its JSON path) is logged and kept
in :class:`ReloadStatus` for ``GET /v2/config/status``.

A repository load may carry a config override (an entry of the model, in
aserve's form; the frontends read Triton's form into one): it is
checked and applied as a reload, and stays in the config in force until a load
without one or a config file that changes that entry.

Sections that only a restart can apply (listeners, limits, drain timeout, gpu)
are compared with what the server started with and reported, not applied.

The reloader is handed what it works on, not the server: the routing table,
the base directory, the config the server started with and where it came
from, a way to read the server's state, and an ``on_swapped`` hook the server
fills (its config's models, the shared devices, gRPC health) that runs right
after each swap.

Each new runtime's load and warm-up is bounded by its ``load_timeout_s``; a
load past it fails the change like any other failed load. So is checking a
config or a repository load's model (handler modules imported), by the longest
``load_timeout_s`` of the config's models (:func:`check_within`). Who waits for a
change in progress is :class:`aserve.loop.changes.ChangeSlot`'s call: a newer
config file supersedes it at once, a repository call waits a few seconds at
most.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from aserve.config import (
    ConfigError,
    DeviceConfig,
    ModelConfig,
    ServerConfig,
    archive_cache,
    parse_config,
)
from aserve.config.pipelines import check_pipelines
from aserve.engines.checks import check_model_files
from aserve.errors import InternalError, InvalidArgument, NotFound, Unavailable
from aserve.loop.archive_sweep import ArchiveSweeper
from aserve.loop.changes import ChangeGivenUp, ChangeSlot
from aserve.loop.memory_budget import MemoryBudget
from aserve.loop.registry import ModelRegistry
from aserve.loop.runtimes.base import Runtime
from aserve.loop.runtimes.factory import create_runtime
from aserve.loop.runtimes.on_demand import OnDemandRuntime
from aserve.workers.offload import run_off_loop

log = logging.getLogger("aserve.reload")

# Top-level config keys that need a restart: listeners, and limits the listeners were built with.
RESTART_KEYS = (
    "http", "grpc", "limits", "auth", "tls", "drain_grace_s", "drain_timeout_s", "gpu",
    "logging", "dashboard",
)  # fmt: skip


@dataclass(frozen=True)
class ConfigSource:
    """Where the running config came from."""

    path: Path
    raw: bytes  # the file's bytes the running config was parsed from
    file_config: ServerConfig  # as the file says, before command-line overrides
    watch_interval_s: float = 1.0  # 0: not watched (SIGHUP still reloads)


class ReloadRejected(Exception):
    """A change that cannot be applied; the message names the JSON path."""


def digest_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class Changes:
    """What one applied change did, by model label (``name/version``)."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # new runtime loaded beside the old
    reconfigured: list[str] = field(default_factory=list)  # applied in place

    def as_dict(self) -> dict[str, list[str]]:
        return {
            "added": self.added,
            "removed": self.removed,
            "replaced": self.replaced,
            "reconfigured": self.reconfigured,
        }

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.replaced or self.reconfigured)


class ReloadStatus:
    """What ``GET /v2/config/status`` reports; ``counts`` are the reload counters
    (by result: ``ok``, ``rejected``, ``unchanged``) a metrics exporter reads."""

    def __init__(self, path: Path | None, digest: str | None, watch_interval_s: float) -> None:
        self.config_file = str(path) if path is not None else None
        self.config_hash = digest
        self.applied_at = _now()
        self.watch_interval_s = watch_interval_s
        self.last: dict[str, Any] | None = None
        self.last_error: dict[str, Any] | None = None
        self.restart_required: list[str] = []
        self.counts = {"ok": 0, "rejected": 0, "unchanged": 0}
        # The change in progress and its loads, as a document (None: none).
        self.in_progress: Callable[[], dict[str, Any] | None] = lambda: None

    def record(
        self,
        trigger: str,
        result: str,
        changes: Changes | None = None,
        error: str | None = None,
    ) -> None:
        self.counts[result] += 1
        entry: dict[str, Any] = {"time": _now(), "trigger": trigger, "result": result}
        if changes is not None:
            entry["changes"] = changes.as_dict()
        if error is not None:
            entry["error"] = error
            self.last_error = {"time": entry["time"], "trigger": trigger, "error": error}
        self.last = entry

    def as_dict(self, models: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "config_file": self.config_file,
            "config_hash": self.config_hash,
            "applied_at": self.applied_at,
            "watch_interval_s": self.watch_interval_s,
            "last_reload": self.last,
            "last_error": self.last_error,
            "restart_required": self.restart_required,
            "reloads": dict(self.counts),
            "in_progress": self.in_progress(),
            "models": models,
        }


class Reloader:
    """Owns config changes of one server: the watcher, reloads, the repository API.

    ``registry`` is the routing table it swaps; ``config`` the config the server
    started with (its ``gpu`` and ``drain_timeout_s``, which only a restart
    changes, are the ones this reloader uses); ``state`` gives the server's
    lifecycle state ("ready" while it serves). ``on_swapped(models, devices)`` is
    awaited right after each swap with the models now served and the config's
    ``devices`` block; whatever it does before
    its first ``await`` happens with no request seeing the new routing first.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        base_dir: Path,
        config: ServerConfig,
        source: ConfigSource | None,
        state: Callable[[], str],
        on_swapped: Callable[[list[ModelConfig], dict[str, DeviceConfig]], Awaitable[None]],
        memory: MemoryBudget | None = None,
    ) -> None:
        self._registry = registry
        # Loads through the server's memory budget (measured, made room for); None:
        # loaded as they are, every model at once (a reloader on its own, in tests).
        self._memory = memory
        self._base_dir = base_dir
        self._gpu = config.gpu
        self._drain_timeout_s = config.drain_timeout_s
        self._state = state
        self._on_swapped = on_swapped
        self._source = source
        self._started_with = source.file_config if source is not None else config
        self._file_config = self._started_with  # the file config now in force
        digest = digest_of(source.raw) if source is not None else None
        self._applied_digest = digest
        self._applied_raw = source.raw if source is not None else None
        self._seen_digest = digest
        interval = source.watch_interval_s if source is not None else 0.0
        self.status = ReloadStatus(source.path if source else None, digest, interval)
        self.unloaded: set[str] = set()  # names unloaded through the repository API
        # On-demand models a repository load loaded: resident until a repository unload.
        self.pinned: set[str] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # the watcher, SIGHUP checks
        self._retiring: set[asyncio.Task[None]] = set()  # drain-then-unload of old runtimes
        self._draining: set[Runtime] = set()  # the runtimes of those tasks
        self._sweeper = ArchiveSweeper(self._lock, self._archive_roots, self._spawn)
        self._slot = ChangeSlot(self._lock, self._reject)
        self.status.in_progress = self._slot.progress_doc
        # Why each model version of the config in force last failed to load, until it loads.
        self.failed: dict[tuple[str, str], str] = {}
        # Entries a repository load's config override replaced, by model key: (the
        # file's entry, the override). The config in force holds the override until a
        # load without one, or a config file that changes that entry.
        self._overrides: dict[tuple[str, str], tuple[ModelConfig, ModelConfig]] = {}

    # --- lifecycle (called by the server) -------------------------------------

    def start(self) -> None:
        """Start watching the config file, if there is one and watching is on; let go
        of cached archives no model uses."""
        self._sweeper.want()
        if self._source is not None and self._source.watch_interval_s > 0:
            self._spawn(self._watch(self._source), "aserve-config-watch")

    def on_sighup(self) -> None:
        """Signal handler: re-read the config file now, even if it looks unchanged."""
        if not self._serving():
            log.warning("SIGHUP received while the server is %s: ignored", self._state())
            return
        log.info("SIGHUP received: checking the config file")
        self._spawn(self.check("SIGHUP", force=True), "aserve-config-sighup")

    async def stop_watching(self) -> None:
        """Stop the watcher and any check or reload in progress (its new models unload)."""
        self._slot.give_up("the server is stopping")  # a repository load's too
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def finish_retiring(self) -> None:
        """Wait for replaced and removed runtimes to drain and unload."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    def loading(
        self, runtimes: Sequence[Runtime], timeouts_s: Sequence[float]
    ) -> contextlib.AbstractContextManager[None]:
        """List ``runtimes`` as loading while the block runs (the server's startup:
        the index says what each load is doing)."""
        return self._slot.loading(runtimes, timeouts_s)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, ChangeGivenUp):  # that one is recorded
            log.error("%s failed", task.get_name(), exc_info=error)

    # --- the config file ------------------------------------------------------

    async def _watch(self, source: ConfigSource) -> None:
        """Poll the file (inode, mtime, size); on a change, check its content."""
        last = await asyncio.to_thread(_fingerprint, source.path)
        # Each check in a task of its own: the watcher keeps watching while a
        # change loads, and a newer file can supersede it (aserve.loop.changes).
        self._spawn(self.check("startup"), "aserve-config-check")  # changed since it was read
        while True:
            await asyncio.sleep(source.watch_interval_s)
            now = await asyncio.to_thread(_fingerprint, source.path)
            if now == last:
                continue
            last = now
            self._spawn(self.check("file change"), "aserve-config-check")

    async def check(self, trigger: str, force: bool = False) -> None:
        """Reload if the file's content differs from the config in force.

        Without ``force``, content already seen (say, a rejected version whose
        file was only touched) is not tried again.
        """
        if self._source is None:
            log.warning("%s: the server has no config file to reload", trigger)
            return
        path = self._source.path
        try:
            raw = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            message = f"{path}: cannot read config: {exc.strerror}"
            log.error("config reload (%s) rejected; the running config stays: %s", trigger, message)
            self.status.record(trigger, "rejected", error=message)
            self._seen_digest = None
            return
        digest = digest_of(raw)
        if digest == self._seen_digest and not force:
            return
        self._seen_digest = digest
        # The same bytes may name archives replaced since: those are read again (by content).
        if digest == self._applied_digest and not (force and self._names_archives()):
            if force:
                log.info("%s: the config file is unchanged", trigger)
            self._slot.settle_on(digest, trigger)
            self.status.record(trigger, "unchanged")
            return
        if self._slot.applying(digest):
            log.info(
                "%s: that config is being applied already (%s)", trigger, self._slot.progress()
            )
            return
        await self.reload(raw, trigger)

    async def reload(self, raw: bytes, trigger: str) -> None:
        """Validate ``raw`` as the new config file and apply it, or keep the old one.

        Raises :class:`ChangeGivenUp` when a newer file superseded it (recorded).
        """
        assert self._source is not None
        digest = digest_of(raw)
        async with self._slot.hold(trigger, digest):
            self._sweeper.want()  # after this change, applied or not: its archives are held
            try:
                # Reading archives and importing handlers: on threads nothing waits for
                # at exit, the imports (user code) bounded too.
                file_config = await run_off_loop(
                    f"reading the config ({trigger})", self._parse, raw
                )
                file_config, overrides = self._keep_overrides(file_config)
                await check_within(f"checking the config ({trigger})", file_config, self._check)
                unloaded = self.unloaded & {m.name for m in file_config.models}
                changes = await self._apply(file_config, unloaded)
            except (ConfigError, ReloadRejected) as exc:
                self._reject(trigger, str(exc))
                return
            except Exception as exc:  # a bug: still rejected, and the status says what failed
                log.exception("config reload (%s) failed", trigger)
                self._reject(trigger, f"internal error: {type(exc).__name__}: {exc}")
                return
            if not changes and digest == self._applied_digest:  # archives read again, all alike
                self.status.record(trigger, "unchanged")
                log.info("%s: the config file and the archives it names are unchanged", trigger)
                return
            self._file_config = file_config
            self.unloaded = unloaded
            for key in self._overrides.keys() - overrides.keys():
                log.info(
                    "the config file changes model '%s/%s': its config override is dropped", *key
                )
            self._overrides = overrides
            self._applied_digest = digest
            self._applied_raw = raw
            self.status.config_hash = digest
            self.status.applied_at = _now()
            self.status.restart_required = self._restart_required(file_config)
            self.status.record(trigger, "ok", changes)
        log.info("config reloaded (%s, %s): %s", trigger, digest[:19], _describe(changes))
        for line in self.status.restart_required:
            log.warning("config change needs a restart to take effect: %s", line)

    def _reread_archives(self, name: str, config: ServerConfig) -> ServerConfig | None:
        """``config``, with the models of ``name`` that an archive gives read again
        from the config's bytes in force: an archive replaced in place since has
        another digest, so another ``root``, and the diff replaces the model. The
        other models stay as they are. None when no model of ``name`` comes from
        an archive. Blocking: runs in a thread; the caller checks it."""
        models = [m for m in config.models if m.name == name]
        if self._applied_raw is None or not any(archive_cache.digest_of(m.root) for m in models):
            return None
        assert self._source is not None
        data = orjson.loads(self._applied_raw)  # parsed before: valid JSON
        again = parse_config(data, source=str(self._source.path), base_dir=self._base_dir)
        fresh = {m.key: m for m in again.models}
        return config.model_copy(update={
            "models": [fresh.get(m.key, m) if m.name == name else m for m in config.models],
        })  # fmt: skip

    def _names_archives(self) -> bool:
        return any(archive_cache.digest_of(m.root) for m in self._file_config.models)

    def _archive_roots(self) -> list[str | None]:
        """Where the models this server may still run live: the config in force
        (unloaded models too: a repository load uses their folder), the routed
        runtimes, the ones draining."""
        runtimes = [*self._registry, *self._draining]
        overridden = [entry.root for entry, _ in self._overrides.values()]  # a load goes back
        return (
            [m.root for m in self._file_config.models]
            + overridden
            + [rt.config.root for rt in runtimes]
        )

    def _parse(self, raw: bytes) -> ServerConfig:
        """Parse and validate (archives read and checked). Blocking: runs in a thread."""
        assert self._source is not None
        path = self._source.path
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON: {exc}") from None
        return parse_config(data, source=str(path), base_dir=self._base_dir)

    def _check(self, config: ServerConfig) -> None:
        """Check files and import handlers. Blocking (user code): runs in a thread."""
        check_model_files(config, self._base_dir)

    def _reject(self, trigger: str, message: str) -> None:
        log.error(
            "config reload (%s) rejected; the running config stays in force:\n  %s",
            trigger, message.replace("\n", "\n  "),
        )  # fmt: skip
        self.status.record(trigger, "rejected", error=message)

    def _restart_required(self, file_config: ServerConfig) -> list[str]:
        old = self._started_with.model_dump(mode="json", include=set(RESTART_KEYS))
        new = file_config.model_dump(mode="json", include=set(RESTART_KEYS))
        return [f"{line} (needs a restart)" for line in _differences(old, new, "")]

    # --- the repository API ---------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every model version of the config in force, with its state (Triton's index)."""
        served = {(rt.name, rt.version): rt for rt in self._registry}
        out = []
        for m in sorted(self._file_config.models, key=lambda m: (m.name, int(m.version))):
            rt = served.get(m.key)
            if isinstance(rt, OnDemandRuntime):  # routed, loaded or not
                state, reason = rt.repository_state()
            elif rt is not None:
                state, reason = rt.state.value, ""
                why = rt.not_ready_reason() if rt.state.value == "READY" else None
                if why is not None:  # loaded, but cannot serve: a pipeline's step is gone, say
                    state, reason = "UNAVAILABLE", why
            elif (loading := self._slot.loading_of(m.key)) is not None:
                state, reason = "LOADING", loading.describe(time.monotonic())
            else:
                reason = "unloaded" if m.name in self.unloaded else "not loaded"
                if m.key in self.failed:  # its last load, since it was last unloaded
                    reason = f"failed to load: {self.failed[m.key]}"
                state = "UNAVAILABLE"
            if ready_only and state != "READY":
                continue
            entry: dict[str, Any] = {
                "name": m.name, "version": m.version, "state": state, "reason": reason,
            }  # fmt: skip
            memory = self._memory.memory_of(m) if self._memory is not None else None
            if memory is not None:  # aserve's own: the footprint and loads, once measured
                entry["memory"] = memory
            out.append(entry)
        return out

    async def load_model(self, name: str, override: dict[str, Any] | None = None) -> None:
        """Load (or reload from its files) every version of ``name`` in the config in force.

        With ``override`` (a model entry of ``name``, aserve's form, its version one
        the config has), that entry is replaced by it, checked as a reload checks
        a config; it stays in force until a load without one (which goes back to
        the file's entry) or a config file that changes that entry. A bad override
        raises InvalidArgument, one that fails to load InternalError, both
        ``failed to load: ...``; either way what is served stays.
        """
        trigger = f"repository load '{name}'"
        if override is not None:
            trigger += " with a config override"
        async with self._slot.hold(trigger):
            self._known(name)
            unloaded = self.unloaded - {name}
            was_pinned = name in self.pinned
            self.pinned.add(name)  # an on-demand model loads now and stays
            self._sweeper.want()
            overrides = {k: v for k, v in self._overrides.items() if k[0] != name}
            try:
                if override is None:
                    file_config = await self._reread(name, self._without_overrides(name))
                else:
                    file_config, held = await self._overridden(name, override)
                    overrides[held[1].key] = held
                routed = self._on_demand_routed(file_config, name)
                if routed:  # loaded in place, as they are, and pinned
                    changes = await _pin_loaded(routed)
                else:
                    changes = await self._apply(file_config, unloaded, reload_names={name})
            except (ConfigError, ReloadRejected) as exc:
                if not was_pinned:
                    self.pinned.discard(name)
                self._reject(trigger, str(exc))
                if override is None:
                    raise InternalError(str(exc)) from None
                message = str(exc)
                if not message.startswith("failed to load: "):
                    message = f"failed to load: {message}"
                if isinstance(exc, ConfigError):  # the override itself is wrong
                    raise InvalidArgument(message) from None
                raise InternalError(message) from None
            self._file_config = file_config
            self._overrides = overrides
            self.unloaded = unloaded
            self.status.record(trigger, "ok", changes)
        log.info("%s: %s", trigger, _describe(changes))

    async def _reread(self, name: str, config: ServerConfig) -> ServerConfig:
        """``config`` with the archives of ``name`` read again, checked (as a config
        reload does: threads nothing waits for at exit, the handler imports bounded)."""
        what = f"reading the archive of model '{name}' again"
        again = await run_off_loop(what, self._reread_archives, name, config)
        if again is None:
            return config
        await check_within(f"checking model '{name}'", again, self._check)
        return again

    async def _overridden(
        self, name: str, entry: dict[str, Any]
    ) -> tuple[ServerConfig, tuple[ModelConfig, ModelConfig]]:
        """The config in force with ``entry`` (an override of ``name``) in place of
        its version's entry, the override checked as a reload checks a model (its
        files, its handler imported); and (the file's entry, the override)."""
        source = f"the config override of model '{name}'"
        model = await run_off_loop(f"reading {source}", self._parse_override, source, entry)
        if model.name != name:
            raise ConfigError(
                f"{source} names model '{model.name}'; leave 'name' out or give '{name}'"
            )
        base = self._file_config
        index = next((i for i, m in enumerate(base.models) if m.key == model.key), None)
        if index is None:
            have = ", ".join(m.version for m in base.models if m.name == name)
            raise ConfigError(
                f"{source} is for version {model.version}, which the config does not have "
                f"(versions: {have}); an override replaces one of the config's entries"
            )
        alone = base.model_copy(update={"models": [model]})
        try:
            await check_within(f"checking {source}", alone, self._check)
        except ConfigError as exc:
            raise ConfigError(f"{source}: " + str(exc).replace("  models[0].", "  ")) from None
        models = list(base.models)
        models[index] = model
        config = _with_models(base, models, source)
        held = self._overrides.get(model.key)
        file_entry = held[0] if held is not None else base.models[index]
        return config, (file_entry, model)

    def _parse_override(self, source: str, entry: dict[str, Any]) -> ModelConfig:
        """Validate an override entry (an archive it names read and checked).
        Blocking: runs in a thread."""
        data = {"archives": self._file_config.archives.model_dump(mode="json"), "models": [entry]}
        try:
            return parse_config(data, source=source, base_dir=self._base_dir).models[0]
        except ConfigError as exc:  # the errors name the entry's keys, not models[0]'s
            raise ConfigError(str(exc).replace("  models[0].", "  ")) from None

    def _without_overrides(self, name: str) -> ServerConfig:
        """The config in force with the file's entries of ``name`` back in place of
        its overrides."""
        config = self._file_config
        if not any(key[0] == name for key in self._overrides):
            return config
        models = [
            self._overrides[m.key][0] if m.key in self._overrides and m.name == name else m
            for m in config.models
        ]
        return config.model_copy(update={"models": models})

    def _keep_overrides(
        self, config: ServerConfig
    ) -> tuple[ServerConfig, dict[tuple[str, str], tuple[ModelConfig, ModelConfig]]]:
        """A new config file's config, with the overrides in force in place of the
        entries the file leaves as they were; and the overrides kept (one whose
        entry the file changed, or removed, is dropped)."""
        kept = {}
        models = list(config.models)
        for i, m in enumerate(models):
            held = self._overrides.get(m.key)
            if held is not None and held[0] == m:
                models[i] = held[1]
                kept[m.key] = held
        if not kept:
            return config, kept
        return _with_models(config, models, "the config with its overrides"), kept

    def entry_of(self, name: str, version: str | None = None) -> ModelConfig:
        """The entry of ``name`` (of ``version``, else its highest) in the config in
        force, an override's if it has one; NotFound when there is none."""
        self._known(name)
        entries = [m for m in self._file_config.models if m.name == name]
        if version is None:
            return max(entries, key=lambda m: int(m.version))
        for m in entries:
            if m.version == version:
                return m
        have = ", ".join(m.version for m in entries)
        raise NotFound(
            f"model '{name}' has no version '{version}' in the config (versions: {have})"
        )

    def _on_demand_routed(self, file_config: ServerConfig, name: str) -> list[OnDemandRuntime]:
        """The routed runtimes of ``name``, when every version of it in ``file_config``
        is routed as an on-demand model of that very config (none otherwise): an
        explicit load pins them and loads them where they are, rather than loading
        a copy beside them, which a memory budget may have no room for."""
        wanted = [m for m in file_config.models if m.name == name]
        routed = {(rt.name, rt.version): rt for rt in self._registry if rt.name == name}
        found = []
        for m in wanted:
            rt = routed.get(m.key)
            if not isinstance(rt, OnDemandRuntime) or rt.config != m:
                return []
            found.append(rt)
        return found

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unroute every version of ``name`` (and of the pipelines using it, if asked).

        Returns once routing no longer reaches them; their queued and running
        requests finish before they unload.
        """
        async with self._slot.hold(f"repository unload '{name}'"):
            self._known(name)
            names = {name}
            if unload_dependents:
                names |= _dependents(self._file_config.models, name)
            unloaded = self.unloaded | names
            self.pinned -= names
            for key in [k for k in self.failed if k[0] in names]:
                del self.failed[key]  # unloaded is what the index says of them now
            changes = await self._apply(self._file_config, unloaded)  # only removals: cannot fail
            self.unloaded = unloaded
            self._sweeper.want()
            self.status.record(f"repository unload '{name}'", "ok", changes)
        log.info("repository unload '%s': %s", name, _describe(changes))

    def _serving(self) -> bool:
        return self._state() == "ready"

    def _known(self, name: str) -> None:
        if not self._serving():
            raise Unavailable(f"the server is {self._state()}")
        if not any(m.name == name for m in self._file_config.models):
            where = self.status.config_file or "the config"
            raise NotFound(f"model '{name}' is not in {where}; add it there to serve it")

    # --- applying a change ----------------------------------------------------

    async def _apply(
        self,
        file_config: ServerConfig,
        unloaded: set[str],
        reload_names: Iterable[str] = (),
    ) -> Changes:
        """Serve ``file_config``'s models except ``unloaded``; raise ReloadRejected
        (having changed nothing) when a new runtime fails to load or warm up.

        Models named in ``reload_names`` get a new runtime even if unchanged.
        """
        registry = self._registry
        want = {m.key: m for m in file_config.models if m.name not in unloaded}
        where = {m.key: f"models[{i}]" for i, m in enumerate(file_config.models)}
        current = {(rt.name, rt.version): rt for rt in registry}
        changes = Changes()
        fresh: list[tuple[ModelConfig, Runtime]] = []
        in_place: list[tuple[Runtime, ModelConfig]] = []
        for key, new in want.items():
            rt = current.get(key)
            how = change_of(rt, new, new.name in reload_names)
            if how == "keep":
                continue
            if how == "reconfigure":
                assert rt is not None
                in_place.append((rt, new))
                changes.reconfigured.append(rt_label(new))
                continue
            (changes.added if how == "add" else changes.replaced).append(rt_label(new))
            runtime = create_runtime(new, self._base_dir, registry, self._gpu, self._memory)
            if isinstance(runtime, OnDemandRuntime) and new.name in self.pinned:
                runtime.pin()  # loaded by _load_all, as a startup model is
            fresh.append((new, runtime))
        removed = [rt for key, rt in current.items() if key not in want]
        changes.removed = [rt.label for rt in removed]

        # An on-demand model being replaced may give its successor its room, even
        # if resident (pinned), until the reload is given up.
        fresh_keys = {m.key for m, _ in fresh}
        leaving = [
            rt for key, rt in current.items()
            if key in fresh_keys and isinstance(rt, OnDemandRuntime)
        ]  # fmt: skip
        for rt in leaving:
            rt.leaving(True)
        try:
            await self._load_all(fresh, where, file_config)
        except BaseException:
            for rt in leaving:
                rt.leaving(False)
            raise
        # From here to the swap, and on into the hook until its first await, there
        # is no await: requests see the old routing or the new one, never a mix,
        # and the server's config names the models served before anyone reads it.
        for rt, new in in_place:
            rt.reconfigure(new)
        left = registry.swap(add=[rt for _, rt in fresh], remove=removed)
        for rt in left:
            self._retire(rt)  # a task: it starts at the next await
        served = [m for m in file_config.models if m.name not in unloaded]
        await self._on_swapped(served, file_config.devices)
        return changes

    async def _load_all(
        self,
        fresh: list[tuple[ModelConfig, Runtime]],
        where: dict[tuple[str, str], str],
        file_config: ServerConfig,
    ) -> None:
        """Load and warm every new runtime beside the served ones, each within its
        ``load_timeout_s`` (``file_config``'s default unless it sets its own); all
        or nothing."""
        runtimes = [rt for _, rt in fresh]
        timeouts = [file_config.load_timeout_of(m) for m, _ in fresh]
        with self._slot.loading(runtimes, timeouts):
            memory = self._memory
            try:
                results = await asyncio.gather(
                    *(
                        rt.load_within(t)
                        if memory is None
                        else memory.load_within(rt, t, why="reload")
                        for rt, t in zip(runtimes, timeouts, strict=True)
                    ),
                    return_exceptions=True,
                )
            except asyncio.CancelledError:  # given up (a newer config) or the server stops
                await asyncio.gather(*(rt.unload() for rt in runtimes), return_exceptions=True)
                raise
        for (m, _), result in zip(fresh, results, strict=True):
            if isinstance(result, BaseException):
                self.failed[m.key] = str(result)
            else:
                self.failed.pop(m.key, None)
        failed = [
            f"{where[m.key]}: model '{rt.label}' failed to load: {result}"
            for (m, rt), result in zip(fresh, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failed:
            await asyncio.gather(*(rt.unload() for rt in runtimes), return_exceptions=True)
            raise ReloadRejected("\n".join(failed))

    def _retire(self, runtime: Runtime) -> None:
        task = asyncio.create_task(self._drain(runtime), name=f"aserve-retire-{runtime.label}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        self._draining.add(runtime)
        task.add_done_callback(lambda _: self._drained(runtime))

    def _drained(self, runtime: Runtime) -> None:
        self._draining.discard(runtime)
        if self._serving():  # at shutdown the next start sweeps
            self._sweeper.want()

    async def _drain(self, runtime: Runtime) -> None:
        """Let a runtime that routing no longer reaches finish its requests, then unload it."""
        timeout = self._drain_timeout_s
        if not await runtime.wait_idle(timeout):
            log.warning(
                "model %s still busy after drain_timeout_s (%.1fs); unloading anyway",
                runtime.label, timeout,
            )  # fmt: skip
        try:
            await runtime.unload()
        except Exception:
            log.exception("unloading model %s failed", runtime.label)
            return
        log.info("model %s drained and unloaded", runtime.label)


async def _pin_loaded(runtimes: list[OnDemandRuntime]) -> Changes:
    """Pin on-demand runtimes and load those not loaded (an explicit load); when
    one fails, ReloadRejected, each unpinned again (back to loading on demand)."""
    results = await asyncio.gather(*(rt.load_pinned() for rt in runtimes), return_exceptions=True)
    failed = [
        f"model '{rt.label}' failed to load: {result}"
        for rt, result in zip(runtimes, results, strict=True)
        if isinstance(result, BaseException)
    ]
    if failed:
        for rt in runtimes:
            rt.unpin()
        raise ReloadRejected("\n".join(failed))
    return Changes(reconfigured=[rt.label for rt in runtimes])


def _with_models(config: ServerConfig, models: list[ModelConfig], source: str) -> ServerConfig:
    """``config`` serving ``models`` (the same keys as its own), the pipelines checked
    again: a step's model may have other tensors now."""
    changed = config.model_copy(update={"models": models})
    lines = check_pipelines(changed)
    if lines:
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines))
    return changed


async def check_within(
    what: str, config: ServerConfig, check: Callable[[ServerConfig], None]
) -> None:
    """``check(config)`` (files checked, handlers imported) on a thread of
    :func:`run_off_loop`, given up after the longest ``load_timeout_s`` of the
    config's models: a handler module whose import never returns fails the
    change (:class:`ReloadRejected`) rather than hold every later one; its
    thread is left running, and the stop says so."""
    timeout_s = max(
        (config.load_timeout_of(m) for m in config.models), default=config.load_timeout_s
    )
    try:
        await asyncio.wait_for(run_off_loop(what, check, config), timeout_s)
    except asyncio.TimeoutError:
        raise ReloadRejected(
            f"{what} did not finish within load_timeout_s ({timeout_s:g} s): importing a "
            "handler module has not returned (it is left running; a fixed version "
            "loads at once, a restart ends it)"
        ) from None


def change_of(
    runtime: Runtime | None, new: ModelConfig, reload: bool = False
) -> Literal["add", "replace", "reconfigure", "keep"]:
    """How serving ``new`` changes what ``runtime`` (None: nothing) serves now:
    a new runtime beside it (also when ``reload``), in place, or not at all.
    What applies in place is the runtime's own class's call (its ``reconfigurable``)."""
    if runtime is None:
        return "add"
    if reload:
        return "replace"
    if new == runtime.config:
        return "keep"
    if type(runtime).reconfigurable(runtime.config, new):
        return "reconfigure"
    return "replace"


def rt_label(config: ModelConfig) -> str:
    return f"{config.name}/{config.version}"


def _describe(changes: Changes) -> str:
    if not changes:
        return "no model changes"
    return "; ".join(f"{k} {', '.join(v)}" for k, v in changes.as_dict().items() if v)


def _fingerprint(path: Path) -> tuple[int, int, int, int] | None:
    """What the file the path leads to looks like, symlinks followed: a ConfigMap
    update swaps in a new file (another inode) behind the same path."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    """Leaf-by-leaf differences of two JSON-like values, as ``path: old -> new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(old.keys() | new.keys()):
            out.extend(
                _differences(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
            )
        return out
    if old == new:
        return []
    return [f"{prefix}: {orjson.dumps(old).decode()} -> {orjson.dumps(new).decode()}"]


def _dependents(models: list[ModelConfig], name: str) -> set[str]:
    """Pipelines that call ``name``, directly or through other pipelines."""
    found: set[str] = set()
    todo = [name]
    while todo:
        target = todo.pop()
        for m in models:
            if m.engine == "pipeline" and m.name not in found:
                if any(step.model == target for step in m.steps):
                    found.add(m.name)
                    todo.append(m.name)
    return found
