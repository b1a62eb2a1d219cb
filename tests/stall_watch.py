"""A loop-stall watchdog for hostile-input tests.

A stall is work that holds the server's event loop: the loop's own CPU time,
or another thread keeping the GIL while the loop waits for it. The server
measures that itself, in CPU time, from the windows of its lag timer
(``aserve_loop_stall_seconds`` on ``/metrics``; see aserve/obs/loop_stalls.py):
a machine that other tenants oversubscribe, or a process stopped for a
while, adds wall time but no work, so it cannot fail a test; a request that
makes the loop compute for a second fails it on any machine. The watchdog
reads that histogram before and after the block, and leaving the block
asserts that no window of it was held longer than ``STALL_BOUND_S``.

Meanwhile ``/v2/health/live`` is polled one request after another on a
connection of its own: the slowest answer (wall time, what a client saw,
whatever the cause) is reported as ``watch.worst_s``, and a probe that gets
no answer within ``HANG_S`` fails the block (a hang, not a slow machine).

    async with watch_loop(server.base) as watch:
        ...  # send the hostile requests
    # leaving the block asserts the bound; watch.held_s is the longest stall
    # (a bucket's upper bound), watch.worst_s the slowest probe

With ``ASERVE_STALL_REPORT`` set to a file, each watched case also appends a
JSON line there (test id, slowest probe, quiet p99, longest stall): ``bench/hostile.py``
runs the hostile tests that way and reports the worst health latency per case.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

QUIET_PROBES = 40
# Work that holds the loop this long, in CPU time, is a stall on any machine
# (the hostile cases' worst is a few hundred ms); a bucket bound of the histogram.
STALL_BOUND_S = 1.0
HANG_S = 60.0  # no answer to a probe this long: the server hangs
STALL_METRIC = "aserve_loop_stall_seconds"
_BUCKET = re.compile(rf'^{STALL_METRIC}_bucket\{{le="([^"]+)"\}} (\S+)$', re.MULTILINE)


def stall_buckets(metrics_text: str) -> dict[float, int]:
    """The stall histogram's cumulative counts by upper bound (``inf`` last), from
    a ``/metrics`` page."""
    counts = {float(le): int(float(n)) for le, n in _BUCKET.findall(metrics_text)}
    assert counts, f"the server reports no {STALL_METRIC} on /metrics"
    return counts


@dataclass
class LoopWatch:
    quiet_p99_s: float
    bound_s: float = STALL_BOUND_S
    probes_s: list[float] = field(default_factory=list)
    hung: int = 0  # probes that got no answer within HANG_S
    before: dict[float, int] = field(default_factory=dict)  # stall buckets when the block began
    after: dict[float, int] = field(default_factory=dict)  # and once it had ended

    @property
    def worst_s(self) -> float:
        """The slowest liveness probe, in wall time."""
        return max(self.probes_s, default=0.0)

    @property
    def windows(self) -> dict[float, int]:
        """Windows of the server's lag timer during the block, by the bucket of
        their held time (each bucket's upper bound; not cumulative)."""
        out, below = {}, 0
        for le in sorted(self.after):
            cumulative = self.after[le] - self.before.get(le, 0)
            out[le] = cumulative - below
            below = cumulative
        return out

    @property
    def held_s(self) -> float:
        """The longest stall during the block, as its bucket's upper bound: at most
        that long (``inf``: past the last bound)."""
        return max((le for le, n in self.windows.items() if n > 0), default=0.0)

    @property
    def over_bound(self) -> int:
        """Windows held longer than ``bound_s`` during the block."""
        assert self.bound_s in self.after, f"{self.bound_s} s is no bucket bound of {STALL_METRIC}"
        return sum(n for le, n in self.windows.items() if le > self.bound_s)

    def check(self) -> None:
        assert self.probes_s, "the watchdog sent no probe while the case ran"
        assert not self.hung, (
            f"the server hangs: {self.hung} of {len(self.probes_s)} liveness probes "
            f"got no answer within {HANG_S:g} s"
        )
        assert self.over_bound == 0, (
            f"the event loop stalled: {self.over_bound} window(s) of its lag timer held "
            f"longer than {self.bound_s:g} s by work (the longest up to {self.held_s:g} s; "
            f"{STALL_METRIC}, CPU time); slowest of {len(self.probes_s)} probes "
            f"{self.worst_s:.3f} s"
        )


async def _probe(session: aiohttp.ClientSession, url: str) -> float | None:
    """One liveness probe's wall time; None when no answer came within HANG_S."""

    async def get() -> None:
        async with session.get(url) as r:
            await r.read()
            assert r.status == 200, f"/v2/health/live answered {r.status}"

    start = time.perf_counter()
    try:
        await asyncio.wait_for(get(), HANG_S)
    except asyncio.TimeoutError:
        return None
    return time.perf_counter() - start


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[float, int]:
    # A scrape closes the server's window it falls in: a stall that ended before
    # the scrape is answered is counted in it, with no tick to wait for.
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=HANG_S)) as r:
        assert r.status == 200, f"/metrics answered {r.status}"
        return stall_buckets(await r.text())


async def _watch(base: str, watch_ready: Any, stop: threading.Event) -> None:
    # A connection of its own, so that the probes never queue behind the case's requests.
    live, metrics = f"{base}/v2/health/live", f"{base}/metrics"
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        quiet = sorted([await _probe(session, live) or HANG_S for _ in range(QUIET_PROBES)])
        p99 = quiet[min(len(quiet) - 1, int(len(quiet) * 0.99))]
        watch = LoopWatch(quiet_p99_s=p99, before=await _scrape(session, metrics))
        watch_ready(watch)
        while True:  # at least one probe, even when the case ends at once
            took = await _probe(session, live)
            watch.probes_s.append(HANG_S if took is None else took)
            watch.hung += took is None
            if stop.is_set():
                break
        watch.after = await _scrape(session, metrics)  # after the block's last answer


@contextlib.asynccontextmanager
async def watch_loop(base: str, *, check: bool = True) -> AsyncIterator[LoopWatch]:
    """Poll the server's liveness while the block runs; assert no stall on exit.

    The probes and scrapes run on a thread with an event loop of its own, so
    that a test that builds or sends something big on its own loop delays
    only itself, never them. (For a server in the test's own process, that
    work is the server loop's too, and counts.)
    """
    ready = threading.Event()
    stop = threading.Event()
    box: list[LoopWatch] = []
    failure: list[BaseException] = []

    def on_ready(watch: LoopWatch) -> None:
        box.append(watch)
        ready.set()

    def run() -> None:
        try:
            asyncio.run(_watch(base, on_ready, stop))
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
    held = watch.held_s
    line = {
        "case": os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)"),
        "worst_ms": watch.worst_s * 1e3,
        "quiet_p99_ms": watch.quiet_p99_s * 1e3,
        "held_ms": held * 1e3 if math.isfinite(held) else None,  # a bucket's upper bound
        "bound_ms": watch.bound_s * 1e3,
        "probes": len(watch.probes_s),
    }
    with open(path, "a") as f:  # one short write per case: lines do not interleave
        f.write(json.dumps(line) + "\n")
