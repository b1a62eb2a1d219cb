"""Letting go of extracted archives no model of this server uses any more (loop layer).

The reloader asks for a sweep (:meth:`ArchiveSweeper.want`) at startup, after
every change to what is served, and when a replaced or removed runtime has
drained and unloaded. A sweep lets go of the folders no model needs under the
reloader's lock, so never while a reload is reading a new config (whose
archives it holds but no model uses yet), then removes, in a thread and outside
the lock, every cached extraction no process holds
(:mod:`aserve.config.archive_cache`). Requests for a sweep while one waits for
the lock are one sweep.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from aserve.config import archive_cache

log = logging.getLogger("aserve.reload")


class ArchiveSweeper:
    """Sweeps the archive cache for one server; ``live_roots`` names the model
    folders it still needs, read under ``lock``."""

    def __init__(
        self,
        lock: asyncio.Lock,
        live_roots: Callable[[], Iterable[str | Path | None]],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
    ) -> None:
        self._lock = lock
        self._live_roots = live_roots
        self._spawn = spawn
        self._waiting = False  # a sweep is spawned and has not read the roots yet

    def want(self) -> None:
        """Sweep once the lock is free (at once if it is)."""
        if self._waiting:
            return
        self._waiting = True
        self._spawn(self._sweep(), "aserve-archive-sweep")

    async def _sweep(self) -> None:
        async with self._lock:
            self._waiting = False
            archive_cache.let_go(list(self._live_roots()))  # quick: closes descriptors
        try:
            # Outside the lock (removing GBs takes a while): a removal is safe at any time.
            removed = await asyncio.to_thread(archive_cache.remove_unused)
        except OSError as exc:
            log.warning("could not sweep the archive cache: %s", exc)
            return
        if removed:
            log.info(
                "removed %d extracted archive(s) no model uses: %s",
                len(removed), ", ".join(d[:12] for d in removed),
            )  # fmt: skip
