"""The stall watchdog counts work that holds the loop, and never a busy machine.

``tests/stall_watch.py`` fails a block when the server's own measure
(``aserve_loop_stall_seconds``, aserve/obs/loop_stalls.py) saw a window of
its lag timer held past the bound by work. Here: the arithmetic on readings
of the clocks for each cause of lateness; a server whose loop computes for
1.5 s of CPU time, and one whose loop waits 1.5 s for a thread that keeps
the GIL, both fail the watchdog; a server stopped (SIGSTOP) for longer than
the bound, which a wall-clock watchdog would have called a stall, passes it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import ServerProcess, start_server, write_config
from inprocess import in_process
from stall_watch import STALL_BOUND_S, LoopWatch, watch_loop

from aserve.obs.loop_stalls import Clocks, held_s

pytestmark = pytest.mark.timeout(120)

HOLD_S = 1.5  # CPU time a test's stall takes: past STALL_BOUND_S on any machine
DUE = 0.02  # the lag timer's interval: due 20 ms after the window begins
START = Clocks(wall_s=0.0, cpu_s=0.0, process_cpu_s=0.0, queued_s=0.0)


def _after(wall: float, cpu: float, process_cpu: float, queued: float | None) -> Clocks:
    return Clocks(wall_s=wall, cpu_s=cpu, process_cpu_s=process_cpu, queued_s=queued)


# --- the arithmetic: one window, from a tick to the next ---------------------------


def test_a_loop_at_work_all_its_interval_but_on_time_holds_nothing() -> None:
    assert held_s(START, _after(0.0205, 0.02, 0.02, 0.0), DUE) == 0.0


def test_the_loop_threads_cpu_time_is_held() -> None:
    after = _after(1.52, 1.5, 1.5, 0.0)  # one callback computed for 1.5 s
    assert held_s(START, after, DUE) == pytest.approx(1.5 - DUE)
    # Without the kernel's run-queue wait, the loop thread's CPU time alone counts.
    assert held_s(START._replace(queued_s=None), after._replace(queued_s=None), DUE) == (
        pytest.approx(1.5 - DUE)
    )


def test_waiting_for_a_thread_that_keeps_the_gil_is_held() -> None:
    # The loop blocked for 1.5 s while another thread computed (one C call).
    after = _after(1.52, 0.001, 1.501, 0.001)
    assert held_s(START, after, DUE) == pytest.approx(1.5 + 0.001 - DUE)
    # Where the run-queue wait is not reported, a GIL wait cannot be told from a
    # machine that gave the loop no CPU: not counted.
    assert held_s(START._replace(queued_s=None), after._replace(queued_s=None), DUE) == 0.0


def test_waiting_for_a_cpu_is_not_held_even_while_other_threads_compute() -> None:
    # Other processes held the CPUs for 1.5 s; a thread of ours ran on another meanwhile.
    after = _after(1.52, 0.004, 0.7, 1.51)
    assert held_s(START, after, DUE) == 0.0


def test_a_stopped_process_is_not_held() -> None:
    after = _after(2.02, 0.001, 0.001, 0.001)  # SIGSTOP for 2 s: blocked, and nothing ran
    assert held_s(START, after, DUE) == 0.0


def test_a_scrape_splits_a_window_and_the_parts_add_up() -> None:
    scrape = _after(0.01, 0.01, 0.01, 0.0)  # before the timer is due: nothing late yet
    tick = _after(0.51, 0.5, 0.5, 0.0)  # the timer ran 490 ms late, the loop computing
    assert held_s(START, scrape, DUE) == 0.0
    assert held_s(scrape, tick, DUE) == pytest.approx(0.49 - (DUE - 0.01))
    assert held_s(scrape, tick, DUE) <= held_s(START, tick, DUE) + 1e-9


def test_the_watch_counts_windows_over_its_bound_from_two_scrapes() -> None:
    before = {0.001: 10, 0.5: 10, 1.0: 10, 2.5: 10, float("inf"): 10}
    after = {0.001: 60, 0.5: 61, 1.0: 61, 2.5: 62, float("inf"): 62}
    watch = LoopWatch(quiet_p99_s=0.001, before=before, after=after, probes_s=[0.01])
    assert watch.windows == {0.001: 50, 0.5: 1, 1.0: 0, 2.5: 1, float("inf"): 0}
    assert watch.over_bound == 1 and watch.held_s == 2.5
    with pytest.raises(AssertionError, match="the event loop stalled"):
        watch.check()
    watch.after = {**after, 2.5: 61, float("inf"): 61}
    assert watch.over_bound == 0 and watch.held_s == 0.5
    watch.check()


# --- real stalls fail the watchdog -------------------------------------------------


def _compute_for(cpu_s: float) -> float:
    """Compute on the calling thread until it has used ``cpu_s`` of CPU time
    (however long that takes on a busy machine); the CPU time it took."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass
    return time.thread_time() - start


def _keep_the_gil_for(cpu_s: float) -> float:
    """One C call that never lets go of the GIL (a builtin summing a range), sized
    to take about ``cpu_s`` of this thread's CPU time; the CPU time it took."""
    start = time.thread_time()
    sum(range(2_000_000))
    per_item = (time.thread_time() - start) / 2_000_000
    begin = time.thread_time()
    sum(range(int(cpu_s / max(per_item, 1e-10))))
    return time.thread_time() - begin


async def test_a_loop_that_computes_fails_the_watchdog(tmp_path: Path) -> None:
    async with in_process({"models": []}, tmp_path) as srv:  # its loop is this test's
        async with watch_loop(srv.base, check=False) as watch:
            took = _compute_for(HOLD_S)  # on the server's loop: nothing else runs there
        assert took >= HOLD_S
        assert watch.over_bound == 1, watch.windows
        with pytest.raises(AssertionError, match="the event loop stalled"):
            watch.check()


async def test_a_thread_keeping_the_gil_fails_the_watchdog(tmp_path: Path) -> None:
    async with in_process({"models": []}, tmp_path) as srv:
        async with watch_loop(srv.base, check=False) as watch:
            took = await asyncio.to_thread(_keep_the_gil_for, 2 * HOLD_S)
        assert took > STALL_BOUND_S * 1.2, f"the GIL was kept for {took:.2f} s of CPU only"
        assert watch.over_bound >= 1, watch.windows
        with pytest.raises(AssertionError, match="the event loop stalled"):
            watch.check()


# --- a stopped server does not --------------------------------------------------------


def _all_stopped(pid: int) -> bool:
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        if state not in ("T", "t"):
            return False
    return True


def _stopped_for(server: ServerProcess, stop_s: float) -> tuple[float, bytes]:
    """SIGSTOP the server; once every thread of it is stopped, send it a liveness
    request; SIGCONT after ``stop_s``. The request's wall time (at least ``stop_s``:
    it was sent to a stopped process) and the answer."""
    pid = server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while not _all_stopped(pid):
            assert time.monotonic() < deadline, "the server never stopped"
            time.sleep(0.001)
        # The kernel completes the handshake for a stopped listener; the request waits.
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        sent = time.monotonic()
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(stop_s)  # how long the machine keeps the server from running
    finally:
        os.kill(pid, signal.SIGCONT)
    with sock:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return time.monotonic() - sent, answer


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread states in /proc")
async def test_a_server_stopped_longer_than_the_bound_passes_the_watchdog(tmp_path: Path) -> None:
    server = start_server(write_config(tmp_path, {"models": []}))
    try:
        async with watch_loop(server.base) as watch:  # leaving it asserts no stall
            took, answer = await asyncio.to_thread(_stopped_for, server, HOLD_S)
        # A client waited past the bound: a watchdog on wall time would have failed here.
        assert took >= HOLD_S > STALL_BOUND_S
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert watch.held_s < STALL_BOUND_S, watch.windows
    finally:
        server.stop()
