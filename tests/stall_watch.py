"""A loop-stall watchdog for hostile-input tests.

While a hostile case runs, ``/v2/health/live`` is polled one request after
another on a connection of its own; the slowest answer must come within
``max(1 s, 20x the quiet p99)``, the quiet p99 measured in the same test just
before. The bound is loose enough for a busy machine and tight enough to catch
a request that holds the event loop for seconds. A probe that gets no answer at
all within the bound counts as a stall too (its time is the bound).

    async with watch_loop(server.base) as watch:
        ...  # send the hostile requests
    # leaving the block asserts the bound; watch.worst_s is the slowest probe

With ``ASERVE_STALL_REPORT`` set to a file, each watched case also appends a
JSON line there (test id, slowest probe, quiet p99, bound): ``bench/hostile.py``
runs the hostile tests that way and reports the worst health latency per case.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

QUIET_PROBES = 40
FLOOR_S = 1.0
FACTOR = 20.0


@dataclass
class LoopWatch:
    quiet_p99_s: float
    bound_s: float
    probes_s: list[float] = field(default_factory=list)

    @property
    def worst_s(self) -> float:
        return max(self.probes_s, default=0.0)

    def check(self) -> None:
        assert self.probes_s, "the watchdog sent no probe while the case ran"
        assert self.worst_s <= self.bound_s, (
            f"the event loop stalled: /v2/health/live took {self.worst_s:.3f} s "
            f"(bound {self.bound_s:.3f} s = max({FLOOR_S} s, {FACTOR}x quiet p99 "
            f"{self.quiet_p99_s * 1e3:.2f} ms); {len(self.probes_s)} probes)"
        )


async def _probe(session: aiohttp.ClientSession, url: str, limit_s: float) -> float:
    async def get() -> None:
        async with session.get(url) as r:
            await r.read()
            assert r.status == 200, f"/v2/health/live answered {r.status}"

    start = time.perf_counter()
    try:
        await asyncio.wait_for(get(), limit_s)
    except asyncio.TimeoutError:
        return limit_s + 1e-3  # no answer within the bound: a stall
    return time.perf_counter() - start


async def _watch(url: str, watch_ready: Any, stop: threading.Event) -> None:
    # A connection of its own, so that the probes never queue behind the case's requests.
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        quiet = sorted([await _probe(session, url, 10.0) for _ in range(QUIET_PROBES)])
        p99 = quiet[min(len(quiet) - 1, int(len(quiet) * 0.99))]
        watch = LoopWatch(quiet_p99_s=p99, bound_s=max(FLOOR_S, FACTOR * p99))
        watch_ready(watch)
        while True:  # at least one probe, even when the case ends at once
            watch.probes_s.append(await _probe(session, url, watch.bound_s))
            if stop.is_set():
                return


@contextlib.asynccontextmanager
async def watch_loop(base: str, *, check: bool = True) -> AsyncIterator[LoopWatch]:
    """Poll the server's liveness while the block runs; assert no stall on exit.

    The probes run on a thread with an event loop of its own, so that a test
    that builds or sends something big on its own loop delays only itself,
    never the probes: what they measure is the server's loop.
    """
    url = f"{base}/v2/health/live"
    ready = threading.Event()
    stop = threading.Event()
    box: list[LoopWatch] = []
    failure: list[BaseException] = []

    def on_ready(watch: LoopWatch) -> None:
        box.append(watch)
        ready.set()

    def run() -> None:
        try:
            asyncio.run(_watch(url, on_ready, stop))
        except BaseException as exc:  # surfaced in the test, not lost in the thread
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="loop-watchdog", daemon=True)
    thread.start()
    await asyncio.to_thread(ready.wait)
    if failure:
        raise failure[0]
    watch = box[0]
    try:
        yield watch
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    if failure:
        raise failure[0]
    _report(watch)
    if check:
        watch.check()


def _report(watch: LoopWatch) -> None:
    path = os.environ.get("ASERVE_STALL_REPORT")
    if not path:
        return
    line = {
        "case": os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)"),
        "worst_ms": watch.worst_s * 1e3,
        "quiet_p99_ms": watch.quiet_p99_s * 1e3,
        "bound_ms": watch.bound_s * 1e3,
        "probes": len(watch.probes_s),
    }
    with open(path, "a") as f:  # one short write per case: lines do not interleave
        f.write(json.dumps(line) + "\n")
