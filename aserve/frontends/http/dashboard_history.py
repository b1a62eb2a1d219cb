"""The dashboard's history: a bounded ring of stats snapshots, sampled on the loop.

Why a ring on the server and not only in the browser: a page opened late (or
reloaded, or on another machine) shows the last ``history_s`` seconds at
once, as a monitor page should, instead of starting empty. What it costs is
bounded and small: one snapshot (a walk over the models' counters, what one
poll of the page costs) every ``sample_interval_s``, kept as its JSON bytes,
at most ``history_s / sample_interval_s`` of them (900 s / 5 s = 180 by
default; the config refuses more than 3600). The open page still polls every
second and keeps its own finer points on top.

Frontends layer, on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("aserve.http")


class DashboardHistory:
    """Snapshots of ``sample()`` every ``interval_s``, the last ``span_s`` seconds of them."""

    def __init__(self, sample: Callable[[], dict[str, Any]], span_s: float, interval_s: float):
        self._sample = sample
        self.span_s = span_s
        self.interval_s = interval_s
        self._ring: deque[bytes] = deque(maxlen=math.ceil(span_s / interval_s) + 1)
        self._joined: bytes | None = None  # json() until the next snapshot

    def __len__(self) -> int:
        return len(self._ring)

    def json(self) -> bytes:
        """The snapshots, oldest first, as one JSON array (no re-encoding). Joined once
        per snapshot: a page opening costs a copy of the bytes, not a walk over them."""
        if self._joined is None:
            self._joined = b"[" + b",".join(self._ring) + b"]"
        return self._joined

    def take(self) -> None:
        """Add one snapshot now (on the loop)."""
        self._ring.append(orjson.dumps(self._sample()))
        self._joined = None

    async def run(self) -> None:
        while True:
            try:
                self.take()
            except Exception:  # a broken snapshot must not end the history
                log.exception("dashboard history: taking a snapshot failed")
            await asyncio.sleep(self.interval_s)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp ``cleanup_ctx``: sampling from the app's start to its cleanup (owned)."""
        task = asyncio.create_task(self.run(), name="aserve-dashboard-history")
        yield
        task.cancel()
        await asyncio.wait([task])  # its CancelledError stays in it; ours would propagate
