"""Signals reach the server while its event loop is stuck: a stop stays bounded.

The server takes SIGINT, SIGTERM and SIGHUP on a thread of its own
(``aserve/workers/signals.py``); with asyncio's handlers, which run on the
loop, a loop stuck in a call that never returns ignored every signal but
SIGKILL. ``tests/frozen_server.py`` is a real server whose loop freezes once it
is ready. That SIGTERM, SIGHUP and a second SIGTERM work on a live loop is in
``tests/test_lifecycle.py``, ``tests/test_hot_reload.py`` and
``tests/test_stuck_loads.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import model_entry, spec, start_server, write_config

from aserve.server import STOP_MARGIN_S
from aserve.workers.last_resort import EXIT_FORCED

REPO = Path(__file__).resolve().parent.parent
FROZEN = Path(__file__).with_name("frozen_server.py")
DRAIN_TIMEOUT_S = 1.0


def _frozen_server(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """A frozen server, once ``frozen`` is logged; its stderr lines so far (still growing)."""
    entry = model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                        [spec("OUTPUT0", "FP32", [16])])  # fmt: skip
    config = write_config(tmp_path, {"drain_timeout_s": DRAIN_TIMEOUT_S, "models": [entry]})
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(
        [sys.executable, str(FROZEN), "--config", str(config), "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    frozen = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.strip() == "frozen":
                frozen.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 60
    while not frozen.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the server never froze:\n" + "".join(lines))
    return proc, lines


def _wait(proc: subprocess.Popen[str], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


@pytest.mark.timeout(120)
def test_sigterm_ends_a_server_whose_loop_is_stuck_by_the_stops_deadline(
    model_dir: Path, tmp_path: Path
) -> None:
    proc, lines = _frozen_server(model_dir, tmp_path)
    proc.send_signal(signal.SIGTERM)
    bound_s = DRAIN_TIMEOUT_S + STOP_MARGIN_S  # drain_grace_s 0 (write_config)
    status = _wait(proc, bound_s + 30)
    log = "".join(lines)
    assert status == EXIT_FORCED, log
    assert f"the server did not stop within {bound_s:g} s" in log


@pytest.mark.timeout(120)
def test_a_second_sigterm_ends_a_server_whose_loop_is_stuck_at_once(
    model_dir: Path, tmp_path: Path
) -> None:
    proc, lines = _frozen_server(model_dir, tmp_path)
    proc.send_signal(signal.SIGTERM)
    # Two signals sent at once may arrive as one: the second goes after the first is seen.
    deadline = time.monotonic() + 30
    while not any("SIGTERM received: draining" in line for line in lines):
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    status = _wait(proc, 20)  # no deadline to wait out: far below it
    log = "".join(lines)
    assert status == EXIT_FORCED, log
    assert "second SIGTERM: stopping without waiting for in-flight requests" in log


@pytest.mark.timeout(120)
def test_ctrl_c_says_a_second_one_stops_now_and_it_does(model_dir: Path, tmp_path: Path) -> None:
    """A live server in its drain grace (30 s): the first SIGINT's log line says what a
    second does, and the second ends it at once, long before the grace is over."""
    entry = model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                        [spec("OUTPUT0", "FP32", [16])])  # fmt: skip
    config = write_config(tmp_path, {"drain_grace_s": 30, "models": [entry]})
    srv = start_server(config)
    try:
        srv.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "SIGINT received: draining" not in srv.log_text():
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.02)
        assert "press Ctrl-C again to stop now" in srv.log_text()
        srv.proc.send_signal(signal.SIGINT)
        status = _wait(srv.proc, 20)  # the grace is 30 s: only the second signal ends it so soon
        assert status == EXIT_FORCED, srv.log_text()
        assert "second SIGINT: stopping without waiting for in-flight requests" in srv.log_text()
    finally:
        srv.proc.kill()
