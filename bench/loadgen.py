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

Open loop (:func:`run_open_loop`, ``--rate``): requests leave at a fixed
arrival rate whatever the server does, each on an idle keep-alive connection
or a new one (at most ``max_connections``), each with an optional client-side
deadline: a request not answered by its deadline is given up and its
connection closed, as a client with a timeout does. Every request sent inside
the window is accounted once: answered 200 in time, late (given up, or 200
after the deadline), refused (429/503: the server said no at once), failed
(any other status) or lost (the connection broke). A request whose time comes
while ``max_connections`` are busy is not sent and counted as ``not_sent``.
Latencies are measured from each request's scheduled send time, so a
generator that falls behind cannot hide the server's queueing.

As a library: :func:`run_load`, :func:`run_open_loop`, :func:`fetch_once`,
:func:`check_outputs`. As a program::

    python -m bench.loadgen URL --body FILE --concurrency N --duration S \
        [--warmup S] [--expect FILE] [--cpu-pid PID] [--snapshot-url URL] [--json]
    python -m bench.loadgen URL --body FILE --rate R [--deadline-ms MS] \
        [--header NAME:VALUE] [--probe-url URL] ...
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


def build_request(
    target: Target,
    body: bytes,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
) -> bytes:
    """One complete POST request; written as is for every request of a run."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST {target.path} HTTP/1.1\r\n"
        f"Host: {target.host}:{target.port}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{extra}"
        "\r\n"
    )
    return head.encode("latin-1") + body


def build_get(target: Target) -> bytes:
    return f"GET {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n\r\n".encode(
        "latin-1"
    )


def _content_length(head: bytes) -> int:
    # At a line start: "Inference-Header-Content-Length:" must not match. aiohttp
    # writes the canonical spelling; fall back to a case-blind search.
    i = head.find(b"\r\nContent-Length:")
    if i < 0:
        i = head.lower().find(b"\r\ncontent-length:")
        if i < 0:
            raise ProtocolError("response has no Content-Length (chunked is not supported)")
    i += 2
    j = head.find(b"\r\n", i)
    return int(head[i + 15 : j if j >= 0 else len(head)])


class ResponseFramer:
    """Cuts whole HTTP/1.1 responses (head and Content-Length body) out of the bytes
    a connection receives, for a client with one request in flight on it."""

    __slots__ = ("_body_at", "_buf", "_need", "_status")

    def __init__(self) -> None:
        self._buf = b""
        self._need = -1  # bytes of the whole response, once its head is parsed
        self._body_at = 0
        self._status = b""

    def feed(self, data: bytes) -> tuple[bytes, bytes, int] | None:
        """``(status, body, extra)`` once a response is complete (``extra``: bytes
        received past it), else None; a head without Content-Length raises
        :class:`ProtocolError`."""
        buf = self._buf + data if self._buf else data
        if self._need < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return None
            self._status = buf[9:12]
            self._body_at = end + 4
            try:
                self._need = end + 4 + _content_length(buf[:end])
            except ValueError as exc:
                raise ProtocolError(f"bad Content-Length: {exc}") from None
        if len(buf) < self._need:
            self._buf = buf
            return None
        need, self._need, self._buf = self._need, -1, b""
        return self._status, buf[self._body_at : need], len(buf) - need


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
        self._framer = ResponseFramer()
        self._sent = 0
        self.answered = 0  # responses read on it (a caller can wait for the one in flight)
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._sent = _perf_ns()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            answer = self._framer.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if answer is None:
            return
        now = _perf_ns()
        self.answered += 1
        status, body, extra = answer
        window = self._window
        if self._once is not None:
            if not self._once.done():
                self._once.set_result((int(status), body))
            return
        if window.recording:
            if status == b"200":
                window.latencies_ns.append(now - self._sent)
            else:
                window.errors += 1
                code = int(status)
                window.statuses[code] = window.statuses.get(code, 0) + 1
        if extra:
            # One request in flight means nothing may follow its response.
            self._fail(ProtocolError(f"{extra} unexpected bytes after a response"))
        elif not window.stopping:
            self._send()

    def _fail(self, exc: Exception) -> None:
        if self._once is not None and not self._once.done():
            self._once.set_exception(exc)
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
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
    headers: dict[str, str] | None = None,
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
    request = build_request(target, body, content_type, headers)
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
    url: str,
    body: bytes,
    content_type: str = "application/json",
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """Send the request once; returns ``(status, body)``."""
    target = Target.parse(url)
    return await exchange(target, build_request(target, body, content_type, headers), timeout_s)


async def exchange(target: Target, request: bytes, timeout_s: float) -> tuple[int, bytes]:
    """Send ``request`` on a new connection, return ``(status, body)``, close it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, bytes]] = loop.create_future()
    window = _Window()
    window.stopping = True  # a one-shot connection never loops or reconnects
    transport, _ = await asyncio.wait_for(
        loop.create_connection(
            lambda: _Connection(request, window, once=done), target.host, target.port
        ),
        timeout_s,
    )
    try:
        return await asyncio.wait_for(done, timeout_s)
    finally:
        transport.close()


# --- open loop ---------------------------------------------------------------------------

REFUSED_STATUSES = frozenset({429, 503})  # "not now": the server declined at admission


class _Ask:
    """One open-loop request: when it was due, whether it counts, how it ended."""

    __slots__ = ("conn", "counted", "due_ns", "ended", "timer")

    def __init__(self, due_ns: int, counted: bool) -> None:
        self.due_ns = due_ns
        self.counted = counted
        self.ended = False
        self.timer: asyncio.TimerHandle | None = None
        self.conn: _OpenConnection | None = None  # the connection carrying it


class _Tally:
    """What an open-loop run records (all on one loop)."""

    def __init__(self) -> None:
        self.sent = 0
        self.not_sent = 0
        self.ok_in_time = 0
        self.late = 0
        self.refused = 0
        self.failed = 0
        self.lost = 0
        self.statuses: dict[int, int] = {}
        self.latencies_ns: list[int] = []  # 200s answered in time
        self.refusal_ns: list[int] = []  # how fast refusals came
        self.lag_ns: list[int] = []  # send time minus due time
        self.pending = 0  # counted requests not ended yet


class _OpenConnection(asyncio.Protocol):
    """A keep-alive connection carrying one open-loop request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._framer = ResponseFramer()
        self.ask: _Ask | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._pool.connected(self)

    def send(self, ask: _Ask) -> None:
        assert self._transport is not None and self.ask is None
        self.ask = ask
        ask.conn = self
        self._pool.sent(ask)
        self._transport.write(self._pool.request)

    def data_received(self, data: bytes) -> None:
        try:
            answer = self._framer.feed(data)
        except ProtocolError:
            self.abort()
            return
        if answer is None:
            return
        status, _, extra = answer
        ask, self.ask = self.ask, None
        if ask is not None:
            self._pool.answered(ask, int(status))
        if extra:
            self.abort()
        else:
            self._pool.idle(self)

    def abort(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ask, self.ask = self.ask, None
        self._pool.gone(self, ask)


class _Pool:
    """Connections of an open-loop run and the accounting of their requests."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        target: Target,
        request: bytes,
        deadline_s: float | None,
        max_connections: int,
    ) -> None:
        self.loop = loop
        self.target = target
        self.request = request
        self.deadline_s = deadline_s
        self.max_connections = max_connections
        self.tally = _Tally()
        self.free: list[_OpenConnection] = []
        self.waiting: list[_Ask] = []  # asks waiting for a connection being opened
        self.opening = 0
        self.open: set[_OpenConnection] = set()
        self.peak_connections = 0
        self.connect_errors = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        self.drained = asyncio.Event()  # set when no counted request is pending

    # requests

    def submit(self, ask: _Ask) -> None:
        """Send ``ask`` now on an idle connection, or on a new one once it is open."""
        t = self.tally
        conn = None
        while self.free and conn is None:
            conn = self.free.pop()
            if conn.closed:
                conn = None
        if conn is None and len(self.open) + self.opening >= self.max_connections:
            if ask.counted:
                t.not_sent += 1
            ask.ended = True
            return
        if ask.counted:
            t.sent += 1
            t.pending += 1
            self.drained.clear()
        if self.deadline_s is not None:
            left = self.deadline_s - (_perf_ns() - ask.due_ns) / 1e9
            ask.timer = self.loop.call_later(max(left, 0.0), self._expired, ask)
        if conn is not None:
            conn.send(ask)
            return
        self.waiting.append(ask)
        self.opening += 1
        task = self.loop.create_task(self._connect())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connect(self) -> None:
        try:
            await self.loop.create_connection(
                lambda: _OpenConnection(self), self.target.host, self.target.port
            )
        except OSError:
            self.opening -= 1
            self.connect_errors += 1
            if self.waiting:
                ask = self.waiting.pop(0)
                if self._end(ask) and ask.counted:
                    self.tally.lost += 1

    def connected(self, conn: _OpenConnection) -> None:
        self.opening -= 1
        self.open.add(conn)
        self.peak_connections = max(self.peak_connections, len(self.open))
        self.idle(conn)

    def idle(self, conn: _OpenConnection) -> None:
        if self.closing:
            conn.abort()
            return
        while self.waiting:
            ask = self.waiting.pop(0)
            if not ask.ended:  # one that expired while waiting is already accounted
                conn.send(ask)
                return
        self.free.append(conn)

    def sent(self, ask: _Ask) -> None:
        if ask.counted:  # written to a connection: how far behind its schedule
            self.tally.lag_ns.append(_perf_ns() - ask.due_ns)

    def _end(self, ask: _Ask) -> bool:
        """Mark ``ask`` ended; False when it already was (each is accounted once)."""
        if ask.ended:
            return False
        ask.ended = True
        if ask.timer is not None:
            ask.timer.cancel()
        if ask.counted:
            self.tally.pending -= 1
            if self.tally.pending == 0:
                self.drained.set()
        return True

    def answered(self, ask: _Ask, status: int) -> None:
        if not self._end(ask) or not ask.counted:
            return
        t = self.tally
        took = _perf_ns() - ask.due_ns
        in_time = self.deadline_s is None or took <= self.deadline_s * 1e9
        if status == 200:
            if in_time:
                t.ok_in_time += 1
                t.latencies_ns.append(took)
            else:
                t.late += 1
            return
        t.statuses[status] = t.statuses.get(status, 0) + 1
        if status in REFUSED_STATUSES:
            t.refused += 1
            t.refusal_ns.append(took)
        else:
            t.failed += 1

    def _expired(self, ask: _Ask) -> None:
        ask.timer = None
        if not self._end(ask):
            return
        if ask.counted:
            self.tally.late += 1
        # The client gives up: its connection goes (the server sees it leave).
        conn = ask.conn
        if conn is not None and conn.ask is ask:
            conn.ask = None
            conn.abort()

    def gone(self, conn: _OpenConnection, ask: _Ask | None) -> None:
        self.open.discard(conn)
        if ask is not None and self._end(ask) and ask.counted:
            self.tally.lost += 1

    def close(self) -> None:
        self.closing = True
        for conn in list(self.open):
            conn.abort()
        for task in list(self.tasks):
            task.cancel()


@dataclass(frozen=True)
class OpenLoopResult:
    rate: float  # offered requests per second
    duration_s: float  # the window in which requests were sent
    deadline_ms: float | None
    sent: int  # requests due in the window and sent (or waiting for a connection to open)
    not_sent: int  # due in the window but max_connections were all busy
    ok_in_time: int  # 200 by the deadline
    late: int  # given up at the deadline, or 200 after it
    refused: int  # 429/503
    failed: int  # any other status
    lost: int  # the connection broke before an answer
    error_statuses: dict[int, int]
    goodput_rps: float  # ok_in_time per second of the window
    in_time_share: float  # ok_in_time / (sent + not_sent)
    admitted: int  # sent - refused
    admitted_in_time_share: float  # ok_in_time / admitted
    p50_ms: float  # of the 200s in time
    p99_ms: float
    max_ms: float
    refusal_p99_ms: float  # how fast refusals came
    send_lag_p99_ms: float  # how late requests left against their schedule (client health)
    peak_connections: int
    connect_errors: int
    client_cpu_util: float
    probe: dict[str, Any] | None  # GET probe_url latencies during the window

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _status_of(target: Target, request: bytes) -> int:
    """Send ``request`` on a new connection; the status once the response head is in.

    Only the head is read, so any framing of the body (chunked too) will do.
    """
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        return int(head[9:12])
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise ProtocolError(f"no response head: {exc!r}") from None
    finally:
        writer.close()


async def _probe(
    target: Target, interval_s: float, window: Any, out: list[float], errors: list[str]
) -> None:
    """GET ``target`` every ``interval_s`` on a new connection; latencies in the window."""
    request = build_get(target)
    while not window.stopping:
        t0 = _perf_ns()
        try:
            status = await asyncio.wait_for(_status_of(target, request), 5.0)
            if status != 200:
                raise ProtocolError(f"status {status}")
        except (OSError, ProtocolError, asyncio.TimeoutError) as exc:
            if window.recording:
                errors.append(repr(exc))
        else:
            if window.recording:
                out.append((_perf_ns() - t0) / 1e6)
        await asyncio.sleep(interval_s)


async def run_open_loop(
    url: str,
    body: bytes,
    rate: float,
    duration_s: float,
    warmup_s: float = 2.0,
    *,
    deadline_ms: float | None = None,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    max_connections: int = 2048,
    probe_url: str | None = None,
    probe_interval_s: float = 0.05,
    on_window_start: Callable[[], None] | None = None,
    on_window_end: Callable[[], None] | None = None,
) -> OpenLoopResult:
    """Send ``rate`` requests per second to ``url``, answered or not; see the module docstring.

    Requests due in the window are counted; after the window no new ones
    leave, and the run waits for the counted ones to end (their deadline
    bounds that; without one, at most 30 s) before it closes everything.
    """
    if rate <= 0 or duration_s <= 0 or warmup_s < 0 or max_connections < 1:
        raise ValueError("need rate > 0, duration_s > 0, warmup_s >= 0, max_connections >= 1")
    loop = asyncio.get_running_loop()
    target = Target.parse(url)
    deadline_s = None if deadline_ms is None else deadline_ms / 1e3
    pool = _Pool(loop, target, build_request(target, body, content_type, headers),
                 deadline_s, max_connections)  # fmt: skip
    window = _Window()
    probe_ms: list[float] = []
    probe_errors: list[str] = []
    probe_task = None
    if probe_url is not None:
        probe_task = loop.create_task(
            _probe(Target.parse(probe_url), probe_interval_s, window, probe_ms, probe_errors)
        )

    async def arrivals() -> None:
        period_ns = 1e9 / rate
        t0 = _perf_ns()
        i = 0
        while not window.stopping:
            now = _perf_ns()
            due = int((now - t0) / period_ns) + 1  # requests due up to now, the first at t0
            while i < due:
                pool.submit(_Ask(t0 + int(i * period_ns), window.recording))
                i += 1
            await asyncio.sleep(max(0.0, (t0 + i * period_ns - _perf_ns()) / 1e9))

    sender = loop.create_task(arrivals())
    try:
        elapsed, cpu = await timed_window(
            window, warmup_s, duration_s, on_window_start, on_window_end
        )
        sender.cancel()
        if pool.tally.pending > 0:
            try:
                await asyncio.wait_for(
                    pool.drained.wait(), deadline_s + 1.0 if deadline_s else 30.0
                )
            except asyncio.TimeoutError:
                pass  # what is still pending counts as late below
    finally:
        window.stopping = True
        sender.cancel()
        if probe_task is not None:
            probe_task.cancel()
        pool.close()
    t = pool.tally
    t.late += t.pending  # still unanswered with no deadline left to wait for
    lat = sorted(ns / 1e6 for ns in t.latencies_ns)
    lag = sorted(ns / 1e6 for ns in t.lag_ns)
    refusals = sorted(ns / 1e6 for ns in t.refusal_ns)
    planned = t.sent + t.not_sent
    admitted = t.sent - t.refused
    probe = None
    if probe_url is not None:
        ps = sorted(probe_ms)
        probe = {
            "url": probe_url, "count": len(ps), "errors": len(probe_errors),
            "error_samples": probe_errors[:3], "p50_ms": percentile(ps, 50),
            "p99_ms": percentile(ps, 99), "max_ms": ps[-1] if ps else math.nan,
        }  # fmt: skip
    return OpenLoopResult(
        rate=rate,
        duration_s=elapsed,
        deadline_ms=deadline_ms,
        sent=t.sent,
        not_sent=t.not_sent,
        ok_in_time=t.ok_in_time,
        late=t.late,
        refused=t.refused,
        failed=t.failed,
        lost=t.lost,
        error_statuses=dict(sorted(t.statuses.items())),
        goodput_rps=t.ok_in_time / elapsed,
        in_time_share=t.ok_in_time / planned if planned else math.nan,
        admitted=admitted,
        admitted_in_time_share=t.ok_in_time / admitted if admitted else math.nan,
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        max_ms=lat[-1] if lat else math.nan,
        refusal_p99_ms=percentile(refusals, 99),
        send_lag_p99_ms=percentile(lag, 99),
        peak_connections=pool.peak_connections,
        connect_errors=pool.connect_errors,
        client_cpu_util=cpu / elapsed,
        probe=probe,
    )


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
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    status, reply = await fetch_once(args.url, body, args.content_type, headers=headers)
    if status != 200:
        raise SystemExit(f"loadgen: first request answered {status}: {reply[:300]!r}")
    if expected is not None:
        check_outputs(reply, expected, args.rtol, args.atol)
    edges: dict[str, Any] = {}
    start, end = _window_hooks(args.cpu_pid, args.snapshot_url, edges)
    result: LoadResult | OpenLoopResult
    if args.rate is not None:
        result = await run_open_loop(
            args.url, body, args.rate, args.duration, args.warmup,
            deadline_ms=args.deadline_ms, content_type=args.content_type, headers=headers,
            max_connections=args.max_connections, probe_url=args.probe_url,
            on_window_start=start, on_window_end=end,
        )  # fmt: skip
        answered = result.sent
    else:
        result = await run_load(
            args.url, body, args.concurrency, args.duration, args.warmup,
            content_type=args.content_type, on_window_start=start, on_window_end=end,
            headers=headers,
        )  # fmt: skip
        answered = result.requests
    out = result.as_dict()
    out["verified"] = expected is not None
    if args.cpu_pid is not None:
        out["server_cpu_s"] = edges["cpu_end"] - edges["cpu_start"]
        out["server_cpu_ms_per_request"] = (
            1e3 * out["server_cpu_s"] / answered if answered else math.nan
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
    p.add_argument("--header", action="append", default=[], help="NAME:VALUE, repeatable")
    p.add_argument("--rate", type=float, help="open loop: requests per second, answered or not")
    p.add_argument("--deadline-ms", type=float, help="open loop: client-side deadline per request")
    p.add_argument("--max-connections", type=int, default=2048, help="open loop: at most")
    p.add_argument("--probe-url", help="open loop: GET this every 50 ms, report its latency")
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
    elif args.rate is not None:
        print(
            f"rate {out['rate']:.0f}/s: sent {out['sent']}, in time {out['ok_in_time']}, late "
            f"{out['late']}, refused {out['refused']}, failed {out['failed']}, lost "
            f"{out['lost']}, not sent {out['not_sent']}; goodput {out['goodput_rps']:.0f}/s, "
            f"admitted in time {out['admitted_in_time_share']:.3f}, p99 {out['p99_ms']:.1f} ms"
        )
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
