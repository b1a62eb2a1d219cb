"""Closed-loop HTTP/1.1 load generator on raw asyncio protocols (uvloop when installed).

``concurrency`` keep-alive connections each keep exactly one request in
flight: when a response is complete the same pre-built request bytes are
written again at once. Parsing is the minimum a keep-alive client needs (the
status code and ``Content-Length``), so one core drives well over 15k req/s
and the server, not this process, is what gets measured.

Run shape: connect, warm up for ``warmup_s`` (nothing recorded), then record
for ``duration_s``. A response counts when it completes inside the window;
throughput is those responses over the window's measured length. Latency
percentiles are over the successful (200) responses; every other status, and
every connection the server drops, counts as an error.

As a library: :func:`run_load`, :func:`fetch_once`, :func:`check_outputs`.
As a program::

    python -m bench.loadgen URL --body FILE --concurrency N --duration S \
        [--warmup S] [--expect FILE] [--cpu-pid PID] [--snapshot-url URL] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

_perf_ns = time.perf_counter_ns


class ProtocolError(Exception):
    """The server answered something this minimal client cannot read."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"'{url}': only http://HOST:PORT/PATH URLs are supported")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, parts.port or 80, path)


def build_request(target: Target, body: bytes, content_type: str = "application/json") -> bytes:
    """One complete POST request; written as is for every request of a run."""
    head = (
        f"POST {target.path} HTTP/1.1\r\n"
        f"Host: {target.host}:{target.port}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body


def _content_length(head: bytes) -> int:
    # aiohttp writes the canonical spelling; fall back to a case-blind search.
    i = head.find(b"Content-Length:")
    if i < 0:
        i = head.lower().find(b"content-length:")
        if i < 0:
            raise ProtocolError("response has no Content-Length (chunked is not supported)")
    j = head.find(b"\r\n", i)
    return int(head[i + 15 : j if j >= 0 else len(head)])


class _Window:
    """What a run records; shared by its connections (all on one loop)."""

    __slots__ = ("errors", "latencies_ns", "lost", "recording", "statuses", "stopping")

    def __init__(self) -> None:
        self.recording = False
        self.stopping = False
        self.latencies_ns: list[int] = []
        self.errors = 0
        self.lost = 0
        self.statuses: dict[int, int] = {}


async def timed_window(
    window: Any,
    warmup_s: float,
    duration_s: float,
    on_window_start: Callable[[], None] | None,
    on_window_end: Callable[[], None] | None,
) -> tuple[float, float]:
    """Warm up, record for ``duration_s``, then tell the callers to stop.

    ``window`` is any object with ``recording``/``stopping`` flags (one per load
    generator). Returns the window's wall seconds and this process's CPU seconds.
    """
    await asyncio.sleep(warmup_s)
    if on_window_start is not None:
        on_window_start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    window.recording = True
    await asyncio.sleep(duration_s)
    window.recording = False
    cpu1, t1 = time.process_time(), time.perf_counter()
    window.stopping = True
    if on_window_end is not None:
        on_window_end()
    return t1 - t0, cpu1 - cpu0


class _Connection(asyncio.Protocol):
    """One keep-alive connection with one request in flight.

    With ``once`` set it sends a single request and resolves the future with
    ``(status, body)`` instead of looping.
    """

    def __init__(
        self,
        request: bytes,
        window: _Window,
        on_lost: Callable[[], None] | None = None,
        once: asyncio.Future[tuple[int, bytes]] | None = None,
    ) -> None:
        self._request = request
        self._window = window
        self._on_lost = on_lost
        self._once = once
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._need = -1  # bytes of the whole response, once its head is parsed
        self._body_at = 0
        self._status = b""
        self._sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._sent = _perf_ns()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        if self._need < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            self._status = buf[9:12]
            self._body_at = end + 4
            try:
                self._need = end + 4 + _content_length(buf[:end])
            except (ProtocolError, ValueError) as exc:
                self._fail(exc)
                return
        if len(buf) < self._need:
            self._buf = buf
            return
        now = _perf_ns()
        need, self._need, self._buf = self._need, -1, b""
        window = self._window
        if self._once is not None:
            if not self._once.done():
                self._once.set_result((int(self._status), buf[self._body_at : need]))
            return
        if window.recording:
            if self._status == b"200":
                window.latencies_ns.append(now - self._sent)
            else:
                window.errors += 1
                code = int(self._status)
                window.statuses[code] = window.statuses.get(code, 0) + 1
        if len(buf) != need:
            # One request in flight means nothing may follow its response.
            self._fail(ProtocolError(f"{len(buf) - need} unexpected bytes after a response"))
        elif not window.stopping:
            self._send()

    def _fail(self, exc: Exception) -> None:
        if self._once is not None and not self._once.done():
            self._once.set_exception(exc)
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._once is not None and not self._once.done():
            self._once.set_exception(ProtocolError(f"connection closed early ({exc})"))
        if self._window.stopping:
            return
        if self._window.recording:
            self._window.errors += 1
        self._window.lost += 1
        if self._on_lost is not None:
            self._on_lost()  # keep the concurrency constant

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    duration_s: float  # measured window
    requests: int  # responses completed inside the window, errors included
    errors: int
    error_statuses: dict[int, int]
    connections_lost: int
    rps: float  # successful responses per second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    client_cpu_util: float  # this process's CPU seconds per wall second in the window

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


async def run_load(
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 2.0,
    *,
    content_type: str = "application/json",
    on_window_start: Callable[[], None] | None = None,
    on_window_end: Callable[[], None] | None = None,
) -> LoadResult:
    """Drive ``url`` with ``concurrency`` closed-loop connections; see the module docstring.

    ``on_window_start`` / ``on_window_end`` run on the loop right outside the
    recorded window (e.g. to read a server's CPU time), so their cost is not
    charged to it.
    """
    if concurrency < 1 or duration_s <= 0 or warmup_s < 0:
        raise ValueError("need concurrency >= 1, duration_s > 0 and warmup_s >= 0")
    loop = asyncio.get_running_loop()
    target = Target.parse(url)
    request = build_request(target, body, content_type)
    window = _Window()
    conns: list[_Connection] = []
    tasks: set[asyncio.Task[None]] = set()

    async def connect() -> None:
        _, proto = await loop.create_connection(
            lambda: _Connection(request, window, on_lost), target.host, target.port
        )
        conns.append(proto)

    def on_lost() -> None:
        task = loop.create_task(connect())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await asyncio.gather(*(connect() for _ in range(concurrency)))
    try:
        elapsed, cpu = await timed_window(
            window, warmup_s, duration_s, on_window_start, on_window_end
        )
    finally:
        window.stopping = True
        for conn in conns:
            conn.close()
        for task in list(tasks):
            task.cancel()

    lat = sorted(ns / 1e6 for ns in window.latencies_ns)
    ok = len(lat)
    return LoadResult(
        concurrency=concurrency,
        duration_s=elapsed,
        requests=ok + window.errors,
        errors=window.errors,
        error_statuses=dict(sorted(window.statuses.items())),
        connections_lost=window.lost,
        rps=ok / elapsed,
        p50_ms=percentile(lat, 50),
        p90_ms=percentile(lat, 90),
        p99_ms=percentile(lat, 99),
        mean_ms=sum(lat) / ok if ok else math.nan,
        max_ms=lat[-1] if lat else math.nan,
        client_cpu_util=cpu / elapsed,
    )


async def fetch_once(
    url: str, body: bytes, content_type: str = "application/json", timeout_s: float = 30.0
) -> tuple[int, bytes]:
    """Send the request once; returns ``(status, body)``."""
    loop = asyncio.get_running_loop()
    target = Target.parse(url)
    done: asyncio.Future[tuple[int, bytes]] = loop.create_future()
    window = _Window()
    window.stopping = True  # a one-shot connection never loops or reconnects
    transport, _ = await loop.create_connection(
        lambda: _Connection(build_request(target, body, content_type), window, once=done),
        target.host,
        target.port,
    )
    try:
        return await asyncio.wait_for(done, timeout_s)
    finally:
        transport.close()


def check_outputs(
    body: bytes, expected: Sequence[float], rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    """Raise ``ValueError`` unless ``outputs[0].data`` of a V2 response matches ``expected``."""
    try:
        data = json.loads(body)["outputs"][0]["data"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a V2 response with outputs[0].data: {body[:200]!r}") from exc
    if len(data) != len(expected):
        raise ValueError(f"outputs[0].data has {len(data)} values, expected {len(expected)}")
    for i, (got, want) in enumerate(zip(data, expected, strict=True)):
        if not abs(got - want) <= atol + rtol * abs(want):
            raise ValueError(f"outputs[0].data[{i}] = {got}, expected {want}")


def _window_hooks(
    cpu_pid: int | None, snapshot_url: str | None, out: dict[str, Any]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Hooks reading CPU times (machine, server) and a JSON document at the window edges.

    They block the loop for a moment, but only outside the recorded window.
    """
    from bench.proctree import system_busy_seconds, tree_cpu_seconds

    def read(edge: str) -> None:
        out[f"busy_{edge}"] = system_busy_seconds()
        if cpu_pid is not None:
            out[f"cpu_{edge}"] = tree_cpu_seconds(cpu_pid)
        if snapshot_url is not None:
            with urllib.request.urlopen(snapshot_url, timeout=10) as r:
                out[f"snapshot_{edge}"] = json.loads(r.read())

    return (lambda: read("start")), (lambda: read("end"))


async def _main(
    args: argparse.Namespace, body: bytes, expected: list[float] | None
) -> dict[str, Any]:
    status, reply = await fetch_once(args.url, body, args.content_type)
    if status != 200:
        raise SystemExit(f"loadgen: first request answered {status}: {reply[:300]!r}")
    if expected is not None:
        check_outputs(reply, expected, args.rtol, args.atol)
    edges: dict[str, Any] = {}
    start, end = _window_hooks(args.cpu_pid, args.snapshot_url, edges)
    result = await run_load(
        args.url, body, args.concurrency, args.duration, args.warmup,
        content_type=args.content_type, on_window_start=start, on_window_end=end,
    )  # fmt: skip
    out = result.as_dict()
    out["verified"] = expected is not None
    if args.cpu_pid is not None:
        out["server_cpu_s"] = edges["cpu_end"] - edges["cpu_start"]
        out["server_cpu_ms_per_request"] = (
            1e3 * out["server_cpu_s"] / result.requests if result.requests else math.nan
        )
        out["server_cpu_util"] = out["server_cpu_s"] / result.duration_s
    # Whatever else kept the machine's cores busy in the window (other tenants,
    # the kernel's network work not charged to either process).
    busy = (edges["busy_end"] - edges["busy_start"]) / result.duration_s
    out["other_cpu_util"] = busy - result.client_cpu_util - out.get("server_cpu_util", 0.0)
    if args.snapshot_url is not None:
        out["snapshots"] = {"start": edges["snapshot_start"], "end": edges["snapshot_end"]}
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("url", help="http://HOST:PORT/PATH to POST to")
    p.add_argument("--body", required=True, help="file with the request body")
    p.add_argument("--content-type", default="application/json")
    p.add_argument("--concurrency", "-c", type=int, default=1, help="connections (default 1)")
    p.add_argument("--duration", "-d", type=float, default=10.0, help="measured seconds")
    p.add_argument("--warmup", "-w", type=float, default=2.0, help="unrecorded seconds first")
    p.add_argument("--expect", help="JSON list the first response's outputs[0].data must match")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--cpu-pid", type=int, help="also report this process tree's CPU time")
    p.add_argument("--snapshot-url", help="GET this JSON (e.g. server stats) at the window edges")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    body = Path(args.body).read_bytes()
    expected = None if args.expect is None else json.loads(Path(args.expect).read_text())
    try:
        out = runner(_main(args, body, expected))
    except ValueError as exc:
        print(f"loadgen: response check failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"c={out['concurrency']} {out['rps']:.0f} req/s  p50 {out['p50_ms']:.3f} ms  "
            f"p99 {out['p99_ms']:.3f} ms  errors {out['errors']}  "
            f"client cpu {out['client_cpu_util']:.0%}"
            + (
                f"  server cpu {out['server_cpu_ms_per_request']:.4f} ms/req"
                if "server_cpu_s" in out
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
