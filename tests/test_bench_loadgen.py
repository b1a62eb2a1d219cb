"""Smoke test of the benchmark's load generator (bench/loadgen.py), closed and open loop.

A small aiohttp server runs on the test's own loop on 127.0.0.1 with routes
that answer at once, slowly, with a refusal or with an error, so the
accounting of each outcome is checked against what the server really did.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import fetch_once, run_load, run_open_loop

pytestmark = pytest.mark.timeout(30)

BODY = b'{"x": 1}'


class Server:
    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.cancelled = 0  # handlers cut short because the client went away
        self.headers: list[str | None] = []
        self.url = ""

    def app(self) -> web.Application:
        async def route(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            self.hits[name] = self.hits.get(name, 0) + 1
            self.headers.append(request.headers.get("aserve-timeout-ms"))
            await request.read()
            if name == "slow":
                try:
                    await asyncio.sleep(0.3)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            if name == "refuse":
                return web.Response(status=503, text="busy")
            if name == "fail":
                return web.Response(status=500, text="broken")
            return web.json_response({"outputs": [{"data": [1.0]}]})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_post("/{name}", route)
        app.router.add_get("/health", health)
        return app


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server()
    runner = web.AppRunner(srv.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    srv.url = f"http://127.0.0.1:{port}"
    yield srv
    await runner.cleanup()


async def test_fetch_once_sends_headers(server: Server) -> None:
    status, body = await fetch_once(server.url + "/ok", BODY, headers={"aserve-timeout-ms": "200"})
    assert status == 200 and b"outputs" in body
    assert server.headers == ["200"]


async def test_closed_loop_counts_answers_and_errors(server: Server) -> None:
    ok = await run_load(server.url + "/ok", BODY, 4, 0.5, 0.1)
    assert ok.requests > 20 and ok.errors == 0 and ok.rps > 0
    assert ok.p50_ms <= ok.p99_ms <= ok.max_ms
    # Every request answered in the window was counted, and no more than the server saw.
    assert ok.requests <= server.hits["ok"]

    bad = await run_load(server.url + "/fail", BODY, 2, 0.3, 0.1)
    assert bad.requests > 0 and bad.errors == bad.requests
    assert bad.error_statuses == {500: bad.errors} and bad.rps == 0


async def test_open_loop_keeps_the_rate_and_answers_in_time(server: Server) -> None:
    r = await run_open_loop(
        server.url + "/ok", BODY, rate=300, duration_s=0.6, warmup_s=0.1, deadline_ms=2000,
        probe_url=server.url + "/health",
    )  # fmt: skip
    # The arrival rate is the schedule's, not the server's pace.
    assert abs(r.sent - 300 * r.duration_s) <= 15, r
    assert r.ok_in_time == r.sent and r.late == r.refused == r.failed == r.lost == 0
    assert r.in_time_share == 1.0 and r.admitted_in_time_share == 1.0
    assert r.goodput_rps == pytest.approx(r.sent / r.duration_s)
    assert r.probe is not None and r.probe["count"] >= 3 and r.probe["errors"] == 0


async def test_open_loop_gives_up_at_the_deadline(server: Server) -> None:
    r = await run_open_loop(
        server.url + "/slow", BODY, rate=50, duration_s=0.6, warmup_s=0.0, deadline_ms=100
    )
    assert r.sent >= 20
    assert r.ok_in_time == 0 and r.late == r.sent and r.admitted == r.sent
    assert r.admitted_in_time_share == 0.0
    # The client closed the connection of each request it gave up on: the server saw it.
    assert server.cancelled >= r.sent - 2
    # Requests do not wait for each other: each needed a connection of its own.
    assert r.peak_connections >= 4


async def test_open_loop_counts_refusals_apart_from_admitted(server: Server) -> None:
    r = await run_open_loop(
        server.url + "/refuse", BODY, rate=100, duration_s=0.5, warmup_s=0.1, deadline_ms=200
    )
    assert r.sent >= 35 and r.refused == r.sent and r.error_statuses == {503: r.sent}
    assert r.admitted == 0 and math.isnan(r.admitted_in_time_share)
    assert r.in_time_share == 0.0 and math.isfinite(r.refusal_p99_ms)  # measured apart

    f = await run_open_loop(server.url + "/fail", BODY, rate=100, duration_s=0.3, warmup_s=0.0)
    assert f.sent > 0 and f.failed == f.sent and f.refused == 0


async def test_open_loop_does_not_exceed_max_connections(server: Server) -> None:
    r = await run_open_loop(
        server.url + "/slow", BODY, rate=40, duration_s=0.5, warmup_s=0.0, deadline_ms=600,
        max_connections=2,
    )  # fmt: skip
    assert r.peak_connections <= 2
    assert r.not_sent > 0 and r.sent <= 2 + 2  # two in flight, maybe two more after 0.3 s
    assert r.in_time_share < 1.0


def test_content_length_is_read_from_its_own_header_not_a_longer_one() -> None:
    from bench.loadgen import _content_length

    head = (
        b"HTTP/1.1 200 OK\r\nInference-Header-Content-Length: 70\r\n"
        b"Content-Type: application/octet-stream\r\nContent-Length: 134"
    )
    assert _content_length(head) == 134
    assert _content_length(b"HTTP/1.1 200 OK\r\ncontent-length: 9") == 9
