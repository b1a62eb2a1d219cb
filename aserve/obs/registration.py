"""This server's entry in the runtime directory, kept current (what ``aserve ps`` lists).

Written once the listeners are bound (state "starting", models "LOADING"),
then rewritten whenever what it says changes: the server's state, or a
model's (loaded, reloaded, unloaded, an instance restarting). Changes are
found by looking a few times a second, the way the gRPC health watcher
does, because a model also turns not ready with no event on the loop.
The entry is removed when the server stops, and at interpreter exit as a
fallback; after SIGKILL it stays, and readers clean it (see
:mod:`aserve.obs.runtime_dir`).

Why a file rather than ``ps`` asking each server over HTTP: it needs no API
key or TLS client setup for servers that require them, answers at once for
a server whose loop is busy, and names servers that are still binding or
loading. The server describes itself in a :class:`Listing` (plain data, built
by ``server.py`` on the loop); this module adds the process's own fields and
writes the entry on a thread.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve import __version__
from aserve.obs import runtime_dir

log = logging.getLogger("aserve.server")

POLL_S = 0.5


@dataclass(frozen=True)
class Listing:
    """What the server says of itself in its entry, now."""

    state: str  # the lifecycle state: "starting", "ready", "draining", "stopped"
    config_file: str | None  # None: the config came from no file
    tls: bool  # the HTTP listeners speak https
    http: Sequence[tuple[str, int]]  # bound (host, port) addresses
    grpc: Sequence[tuple[str, int]]
    models: Sequence[dict[str, str]]  # the repository index: name, version, state, reason


class Registration:
    def __init__(self, listing: Callable[[], Listing], folder: Path | None = None) -> None:
        self._listing = listing  # called on the loop, a few times a second
        self._folder = folder or runtime_dir.runtime_dir()
        self._pid = os.getpid()
        self._started_at = time.time()
        self._proc_start = runtime_dir.process_start_time(self._pid)
        self._last: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._written = False
        # A write still running on its thread when close() removes the entry must not
        # bring it back: both take the lock, and nothing is written once closed.
        self._file_lock = threading.Lock()
        self._closed = False
        self._published = False
        # One write at a time, in the order their snapshots were taken: a refresh()
        # beside the poll must not let an older snapshot land last.
        self._writing: asyncio.Lock | None = None

    def snapshot(self) -> dict[str, Any]:
        """What the entry says now (on the loop: the listing reads the registry)."""
        listing = self._listing()
        starting = listing.state == "starting"
        models = []
        for m in listing.models:
            state = m["state"]
            if starting and state == "UNAVAILABLE" and m["reason"] == "not loaded":
                state = "LOADING"
            models.append({"name": m["name"], "version": m["version"], "state": state})
        scheme = "https" if listing.tls else "http"
        return {
            "pid": self._pid,
            "proc_start": self._proc_start,
            "started_at": self._started_at,
            "version": __version__,
            "command": shlex.join(["aserve", *sys.argv[1:]]),
            "config": listing.config_file,
            "http": [f"{scheme}://{_host(h)}:{p}" for h, p in listing.http],
            "grpc": [f"{_host(h)}:{p}" for h, p in listing.grpc],
            "state": listing.state,
            "models": models,
        }

    async def publish(self) -> None:
        """Write the entry (the listeners are bound) and keep it current until :meth:`close`."""
        self._published = True
        atexit.register(self._remove)
        await self._write_if_changed()
        self._task = asyncio.create_task(self._refresh(), name="aserve-registration")

    async def refresh(self) -> None:
        """Write the entry now if what it says changed, not at the next look: the
        server just became ready, and ``aserve ps`` run after its first answer
        must not say it is loading."""
        if self._published:
            await self._write_if_changed()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self._write_if_changed()

    async def _write_if_changed(self) -> None:
        if self._writing is None:
            self._writing = asyncio.Lock()
        async with self._writing:
            snap = self.snapshot()
            if snap == self._last:
                return
            self._last = snap
            try:
                await asyncio.to_thread(self._write_threadsafe, snap)
                self._written = True
            except OSError as exc:  # ps will not list this server; serving goes on
                if not self._written:
                    log.warning("cannot register in %s (aserve ps): %s", self._folder, exc)

    async def close(self) -> None:
        """Stop refreshing and remove the entry."""
        if not self._published:
            return  # the listeners did not bind
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # its cancellation, not ours
            self._task = None
        # Also when no write has finished yet: one may be running on its thread.
        await asyncio.to_thread(self._remove)
        atexit.unregister(self._remove)

    def remove_threadsafe(self) -> None:
        """Remove the entry now, from any thread, without the loop (a forced exit,
        which skips ``atexit``)."""
        if self._published:
            self._remove()

    def _write_threadsafe(self, snap: dict[str, Any]) -> None:
        with self._file_lock:
            if not self._closed:
                runtime_dir.write_entry(self._folder, self._pid, snap)

    def _remove(self) -> None:
        with self._file_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                runtime_dir.remove_entry(self._folder, self._pid)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
