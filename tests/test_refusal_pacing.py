"""Refusals in a row on one HTTP connection are paced while the loop lags: a client
that retries the moment it is refused is slowed by the server's clock, not served by
its loop; at a loop that keeps up, refusals are answered at once.

The hold itself is a pure function and a per-connection count, driven here on a
fake clock and a lag the test sets; the server test checks, without timing
anything, that a real connection refused again and again gets every refusal (held
or not) and is served afterwards.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from conftest import ServerProcess, affine_and_spin, start_server, write_config
from helpers import frozen, sync_wait_for_stats
from stall_watch import watch_loop

from aserve.frontends.http.limits import (
    PACE_FIRST_S,
    PACE_LAG_S,
    PACE_MAX_S,
    PACE_RESET_S,
    ConnectionGuard,
    refusal_hold_s,
)

pytestmark = pytest.mark.timeout(90)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _guard(clock: FakeClock, lag: list[float] | None = None) -> ConnectionGuard:
    """A guard on ``clock`` whose loop lags ``lag[0]`` seconds (by default 50 ms: a storm's)."""
    lag = [0.05] if lag is None else lag
    return ConnectionGuard(header_timeout_s=10.0, max_pending=8, max_serving=None,
                           rejected={}, fd_limit=None, fds_in_use=0, clock=clock,
                           loop_lag=lambda: lag[0])  # fmt: skip


def test_the_hold_doubles_from_the_second_refusal_and_stays_under_the_budget() -> None:
    assert refusal_hold_s(1, 0.2) == 0.0  # the first refusal in a row: at once
    holds = [refusal_hold_s(n, 0.2) for n in range(2, 8)]
    assert holds == pytest.approx([0.02, 0.04, 0.08, 0.15, 0.15, 0.15])  # 0.75 of 200 ms
    unbounded = [refusal_hold_s(n, None) for n in range(2, 9)]
    assert unbounded == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5])
    assert refusal_hold_s(10**9, 60.0) == PACE_MAX_S  # a long run: no overflow, the cap
    assert refusal_hold_s(5, 0.01) == pytest.approx(0.0075)  # a short budget: its share


def test_runs_are_counted_per_connection_and_halved_by_a_served_request() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    a, b = object(), object()
    assert [guard.refusal_hold(a, 0.2) for _ in range(3)] == [0.0, PACE_FIRST_S, 2 * PACE_FIRST_S]
    assert guard.refusal_hold(b, 0.2) == 0.0  # another connection starts its own run
    guard.served(a)  # 3 in a row -> 1
    assert guard.refusal_hold(a, 0.2) == PACE_FIRST_S  # the run's second
    guard.served(a)  # 2 -> 1
    guard.served(a)  # 1 -> 0: the connection is forgotten
    assert a not in guard.refused_in_a_row
    assert guard.refusal_hold(a, 0.2) == 0.0
    guard.served(object())  # a connection never refused: nothing to do


def test_a_client_that_waited_before_asking_again_starts_a_new_run() -> None:
    clock = FakeClock()
    guard = _guard(clock)
    conn = object()
    for _ in range(4):
        hold = guard.refusal_hold(conn, None)
        clock.now += hold  # the answer goes out after the hold; the client resends at once
    assert hold == 4 * PACE_FIRST_S
    clock.now += PACE_RESET_S - 1e-3  # waited, but less than the reset
    assert guard.refusal_hold(conn, None) == 8 * PACE_FIRST_S
    clock.now += 8 * PACE_FIRST_S + PACE_RESET_S  # waited long enough after that answer
    assert guard.refusal_hold(conn, None) == 0.0


def test_a_run_starts_only_while_the_loop_lags() -> None:
    """An open-loop client's pool reuses the connection it was just refused on, so its
    refusals come in a row too; while the loop keeps up they cost little, and holding
    them only slowed its refusals (p99 15-35 ms -> 170-190 ms in the overload bench)."""
    clock = FakeClock()
    lag = [0.0]
    guard = _guard(clock, lag)
    conn = object()
    assert [guard.refusal_hold(conn, 0.2) for _ in range(6)] == [0.0] * 6
    assert conn not in guard.refused_in_a_row
    lag[0] = PACE_LAG_S  # the loop falls behind: the run starts now
    holds = []
    for _ in range(3):
        holds.append(guard.refusal_hold(conn, 0.2))
        clock.now += holds[-1]  # the client resends the moment its answer is out
    assert holds == [0.0, PACE_FIRST_S, 2 * PACE_FIRST_S]


def test_a_run_goes_on_once_the_loop_has_caught_up() -> None:
    """The pacing is what lets the loop catch up: a run dropped as soon as the lag fell
    let the same clients flood it again within a few passes (the storm's lag-gated pace
    swung between the two). It ends when the client waits before asking again."""
    clock = FakeClock()
    lag = [PACE_LAG_S]
    guard = _guard(clock, lag)
    conn = object()
    for _ in range(3):
        clock.now += guard.refusal_hold(conn, 0.2)
    lag[0] = 0.0  # the loop keeps up now
    hold = guard.refusal_hold(conn, 0.2)
    assert hold == 4 * PACE_FIRST_S  # the run's fourth, held as before
    clock.now += hold + PACE_RESET_S  # the client waits before its next request
    assert guard.refusal_hold(conn, 0.2) == 0.0  # at a loop that keeps up: at once,
    assert conn not in guard.refused_in_a_row  # and the run is over


class _Handler:
    """What the guard touches of aiohttp's RequestHandler (hashable, as that is)."""

    _request_handler: Any = None

    def force_close(self) -> None:
        pass


async def test_a_closed_connection_is_forgotten() -> None:
    guard = _guard(FakeClock())
    server = SimpleNamespace(connection_made=lambda h, t: None,
                             connection_lost=lambda h, e: None, request_handler=None)  # fmt: skip
    guard.install(server)  # type: ignore[arg-type]
    handler = _Handler()
    server.connection_made(handler, None)
    guard.refusal_hold(handler, None)
    guard.refusal_hold(handler, None)
    server.connection_lost(handler, None)
    assert guard.refused_in_a_row == {}


# --- a real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_at_a_time(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    models = affine_and_spin(model_dir)
    config = {"limits": {"max_concurrency": 1}, "models": models}
    srv = start_server(write_config(tmp_path_factory.mktemp("pacing"), config))
    yield srv
    srv.stop()


AFFINE = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
SPIN = {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 0.0]}]}


async def _post(session: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> int:
    async with session.post(url, json=doc, headers={"aserve-timeout-ms": "200"}) as r:
        await r.read()
        return r.status


async def test_a_connection_refused_again_and_again_is_paced_and_served_after(
    one_at_a_time: ServerProcess,
) -> None:
    base = one_at_a_time.base
    held: list[int] = []

    def send_held() -> None:  # holds the one admission slot while the worker is frozen
        async def one() -> None:
            async with aiohttp.ClientSession() as s:
                held.append(await _post(s, f"{base}/v2/models/spin/infer", SPIN))

        asyncio.run(one())

    async with watch_loop(base):
        with frozen(one_at_a_time.worker_pid("spin")):
            thread = threading.Thread(target=send_held)
            thread.start()
            await asyncio.to_thread(
                sync_wait_for_stats, base, "spin", lambda s: s["running_batch_count"] == 1
            )
            # One keep-alive connection that resends the moment it is refused.
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as session:
                statuses = [
                    await _post(session, f"{base}/v2/models/affine/infer", AFFINE) for _ in range(4)
                ]
                assert statuses == [429] * 4  # held or not, each refusal is answered
                # A second connection's first refusal starts a run of its own.
                async with aiohttp.ClientSession() as other:
                    assert await _post(other, f"{base}/v2/models/affine/infer", AFFINE) == 429
        await asyncio.to_thread(thread.join, 60)
        assert held == [200]
        # The paced connection is served as soon as there is room.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            assert await _post(session, f"{base}/v2/models/affine/infer", AFFINE) == 200
