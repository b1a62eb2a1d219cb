"""A retry storm, then a burst: the closed-loop overload clients make, and the moment after.

    python -m bench.storm URL --body FILE --clients 256 --duration S [--warmup S] \
        --deadline-ms MS [--header NAME:VALUE] [--probe-url URL] [--cpu-pid PID] \
        [--snapshot-url URL] [--gap S] [--burst N]

Storm: ``clients`` keep-alive connections, each with one request in flight,
each resending the moment it has an answer, whatever the answer (a client
that retries a refusal at once). A connection the server drops is opened
again. Over the recorded window every answer is classified: in time (200
within ``deadline_ms`` of its send), late (a 200 after it, or a 504),
refused (429/503), failed (any other status) or lost (the connection
broke). Admitted = answered - refused. While it runs, a separate process
(so that the storm's own loop does not delay it) GETs ``probe_url`` on a new
connection every 50 ms.

Burst: ``gap`` seconds after the storm has stopped (all its connections
closed), ``burst`` requests on connections opened beforehand are written in
one go; each answer is classified the same way.

The server's CPU over the window is read with psutil: its main process
alone (the event loop, and any executor threads) and its whole tree.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from bench.loadgen import (
    ProtocolError,
    ResponseFramer,
    Target,
    _status_of,
    build_get,
    build_request,
    percentile,
)

_perf_ns = time.perf_counter_ns
REFUSED = (429, 503)


class _Tally:
    __slots__ = ("failed", "in_time", "late", "lost", "ok_ms", "recording", "refusal_ms",
                 "refused", "statuses", "stopping")  # fmt: skip

    def __init__(self) -> None:
        self.recording = False
        self.stopping = False
        self.in_time = self.late = self.refused = self.failed = self.lost = 0
        self.statuses: dict[int, int] = {}
        self.ok_ms: list[float] = []  # 200s in time
        self.refusal_ms: list[float] = []

    def add(self, status: int, ms: float, deadline_ms: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200:
            if ms <= deadline_ms:
                self.in_time += 1
                self.ok_ms.append(ms)
            else:
                self.late += 1
        elif status == 504:
            self.late += 1
        elif status in REFUSED:
            self.refused += 1
            self.refusal_ms.append(ms)
        else:
            self.failed += 1

    def as_dict(self, seconds: float) -> dict[str, Any]:
        answered = self.in_time + self.late + self.refused + self.failed
        admitted = answered - self.refused
        ok, ref = sorted(self.ok_ms), sorted(self.refusal_ms)
        return {
            "answered": answered, "in_time": self.in_time, "late": self.late,
            "refused": self.refused, "failed": self.failed, "lost": self.lost,
            "admitted": admitted,
            "admitted_in_time_share": self.in_time / admitted if admitted else math.nan,
            "goodput_rps": self.in_time / seconds if seconds else math.nan,
            "refusals_per_s": self.refused / seconds if seconds else math.nan,
            "p50_in_time_ms": percentile(ok, 50), "p99_in_time_ms": percentile(ok, 99),
            "refusal_p50_ms": percentile(ref, 50), "refusal_p99_ms": percentile(ref, 99),
            "statuses": dict(sorted(self.statuses.items())),
        }  # fmt: skip


class _Client(asyncio.Protocol):
    """One keep-alive connection; resends at once (storm) or sends once (burst)."""

    def __init__(
        self, request: bytes, tally: _Tally, deadline_ms: float, again: bool,
        on_lost: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self._request = request
        self._tally = tally
        self._deadline_ms = deadline_ms
        self._again = again
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._framer = ResponseFramer()
        self._sent = 0
        self.body = b""  # the last answer's body (burst only)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if self._again:
            self.send()

    def send(self) -> None:
        assert self._transport is not None
        self._sent = _perf_ns()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            answer = self._framer.feed(data)
        except ProtocolError:
            self.close()
            return
        if answer is None:
            return
        ms = (_perf_ns() - self._sent) / 1e6
        status, body, _ = answer
        tally = self._tally
        if tally.recording or not self._again:
            tally.add(int(status), ms, self._deadline_ms)
        if not self._again:
            self.body = body
            if not self.done.done():
                self.done.set_result(None)
        elif not tally.stopping:
            self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self._tally.stopping:
            return
        if self._tally.recording or not self._again:
            self._tally.lost += 1
        if self._on_lost is not None:
            self._on_lost()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _probe_process(url: str, delay_s: float, seconds: float, interval_s: float, conn: Any) -> None:
    """In its own process: GET ``url`` every ``interval_s`` for ``seconds``; send the latencies."""

    async def main() -> tuple[list[float], list[str]]:
        target = Target.parse(url)
        request = build_get(target)
        await asyncio.sleep(delay_s)
        ms: list[float] = []
        errors: list[str] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = _perf_ns()
            try:
                status = await asyncio.wait_for(_status_of(target, request), 5.0)
                if status != 200:
                    raise ProtocolError(f"status {status}")
                ms.append((_perf_ns() - t0) / 1e6)
            except (OSError, ProtocolError, asyncio.TimeoutError) as exc:
                errors.append(repr(exc))
            await asyncio.sleep(interval_s)
        return ms, errors

    conn.send(asyncio.run(main()))
    conn.close()


def _probe_stats(ms: list[float], errors: list[str]) -> dict[str, Any]:
    ms = sorted(ms)
    return {"count": len(ms), "errors": len(errors), "first_errors": errors[:3],
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": ms[-1] if ms else math.nan}  # fmt: skip


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` alone (threads included) and of its whole tree."""
    import psutil

    from bench.proctree import tree_cpu_seconds

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system, tree_cpu_seconds(pid)


def _snapshot(url: str | None) -> Any:
    if url is None:
        return None
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def storm(
    target: Target, request: bytes, clients: int, warmup_s: float, duration_s: float,
    deadline_ms: float, probe_url: str | None, cpu_pid: int | None, snapshot_url: str | None,
) -> dict[str, Any]:  # fmt: skip
    from bench.proctree import system_busy_seconds

    loop = asyncio.get_running_loop()
    tally = _Tally()
    conns: list[_Client] = []
    tasks: set[asyncio.Task[None]] = set()

    async def connect() -> None:
        _, proto = await loop.create_connection(
            lambda: _Client(request, tally, deadline_ms, True, on_lost), target.host, target.port
        )
        conns.append(proto)

    def on_lost() -> None:
        task = loop.create_task(connect())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    probe = None
    if probe_url is not None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        probe = ctx.Process(target=_probe_process,
                            args=(probe_url, warmup_s, duration_s, 0.05, child), daemon=True)  # fmt: skip
        probe.start()
        child.close()
    await asyncio.gather(*(connect() for _ in range(clients)))
    await asyncio.sleep(warmup_s)
    before = (_cpu(cpu_pid) if cpu_pid else None, _snapshot(snapshot_url), system_busy_seconds())
    own0, t0 = time.process_time(), time.perf_counter()
    tally.recording = True
    await asyncio.sleep(duration_s)
    tally.recording = False
    seconds, own = time.perf_counter() - t0, time.process_time() - own0
    after = (_cpu(cpu_pid) if cpu_pid else None, _snapshot(snapshot_url), system_busy_seconds())
    tally.stopping = True
    for c in conns:
        c.close()
    for task in list(tasks):
        task.cancel()
    out = tally.as_dict(seconds)
    out.update(clients=clients, duration_s=seconds, client_cpu_util=own / seconds)
    if cpu_pid:
        (main0, tree0), (main1, tree1) = before[0], after[0]  # type: ignore[misc]
        out["server_main_cpu_s"] = main1 - main0
        out["server_tree_cpu_s"] = tree1 - tree0
    out["machine_busy_cores"] = (after[2] - before[2]) / seconds
    if snapshot_url is not None:
        out["snapshots"] = {"start": before[1], "end": after[1]}
    if probe is not None:
        ms, errors = await asyncio.to_thread(parent.recv)
        probe.join(10)
        out["probe"] = _probe_stats(ms, errors)
    return out


async def burst(target: Target, request: bytes, n: int, deadline_ms: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    tally = _Tally()
    conns = []
    for _ in range(n):
        _, proto = await loop.create_connection(
            lambda: _Client(request, tally, deadline_ms, False), target.host, target.port
        )
        conns.append(proto)
    for c in conns:  # all in one go: one loop pass here, a few on the server
        c.send()
    await asyncio.wait_for(asyncio.gather(*(c.done for c in conns)), 30)
    for c in conns:
        c.close()
    out = tally.as_dict(0.0)
    out["size"] = n
    refusals = [c.body.decode(errors="replace") for c in conns if c.body.startswith(b'{"error"')]
    out["first_errors"] = refusals[:2]
    out["latencies_ms_max"] = max(tally.ok_ms) if tally.ok_ms else math.nan
    return out


async def _main(args: argparse.Namespace, body: bytes) -> dict[str, Any]:
    target = Target.parse(args.url)
    headers = {k.strip(): v.strip() for k, v in (h.split(":", 1) for h in args.header)}
    request = build_request(target, body, headers=headers)
    out: dict[str, Any] = {}
    if args.clients > 0:
        out["storm"] = await storm(
            target, request, args.clients, args.warmup, args.duration, args.deadline_ms,
            args.probe_url, args.cpu_pid, args.snapshot_url,
        )  # fmt: skip
    if args.burst > 0:
        await asyncio.sleep(args.gap)
        margin = _snapshot(args.snapshot_url)
        out["burst"] = await burst(target, request, args.burst, args.deadline_ms)
        out["burst"]["gap_s"] = args.gap
        if margin is not None:
            out["burst"]["margin_before"] = margin["model_stats"][0].get("admission_margin")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.storm", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--body", required=True)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--deadline-ms", type=float, default=200.0)
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--probe-url")
    p.add_argument("--cpu-pid", type=int)
    p.add_argument("--snapshot-url")
    p.add_argument("--gap", type=float, default=3.0, help="seconds between storm and burst")
    p.add_argument("--burst", type=int, default=32, help="requests sent together (0: none)")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    print(json.dumps(runner(_main(args, Path(args.body).read_bytes()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
