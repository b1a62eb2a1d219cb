"""``aserve ps``: real servers register in the runtime directory; the command lists them.

Servers run with ``ASERVE_RUNTIME_DIR`` in a temporary folder. A server
stopped by SIGTERM removes its entry; one killed by SIGKILL leaves it, and
``ps`` skips and deletes it, as it does an entry whose pid now belongs to
another process (pid reuse).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import HANDLERS, model_entry, spec, start_server, write_config

from aserve.obs import runtime_dir

pytestmark = pytest.mark.timeout(180)


def ps(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASERVE_RUNTIME_DIR": str(folder)}
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "ps", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def ps_json(folder: Path) -> list[dict[str, Any]]:
    return json.loads(ps(folder, "--json").stdout)


def wait_for(folder: Path, check: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Run ``aserve ps --json`` until ``check(entries)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        entries = ps_json(folder)
        if check(entries):
            return entries
        assert time.monotonic() < deadline, f"never held: {entries}"
        time.sleep(0.1)


def by_pid(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["pid"]: e for e in entries}


def test_ps_lists_running_servers_and_drops_stopped_and_killed_ones(
    model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    env = {"ASERVE_RUNTIME_DIR": str(run_dir)}
    config = write_config(
        tmp_path,
        {"grpc": {"port": 0}, "models": [
            model_entry("affine", str(model_dir / "affine.pt"),
                        [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])]),
        ]},
    )  # fmt: skip
    a = start_server(config, extra_env=env)
    b = start_server(
        None,
        extra_env=env,
        argv=["serve", str(model_dir / "pair.pt2"), "--port", "0", "--no-grpc"],
    )
    try:

        def both_ready(entries: list[dict[str, Any]]) -> bool:
            got = by_pid(entries)
            return all(
                p in got and got[p]["state"] == "ready"
                and all(m["state"] == "READY" for m in got[p]["models"])
                for p in (a.proc.pid, b.proc.pid)
            )  # fmt: skip

        got = by_pid(wait_for(run_dir, both_ready))
        assert set(got) == {a.proc.pid, b.proc.pid}
        ea, eb = got[a.proc.pid], got[b.proc.pid]
        assert ea["http"] == [f"http://127.0.0.1:{a.port}"]
        assert ea["grpc"] == [f"127.0.0.1:{a.grpc_port}"]
        assert ea["config"] == str(config)
        assert ea["models"] == [{"name": "affine", "version": "1", "state": "READY"}]
        assert eb["http"] == [f"http://127.0.0.1:{b.port}"] and eb["grpc"] == []
        assert eb["config"] is None and eb["command"].startswith("aserve serve ")
        assert eb["models"] == [{"name": "pair", "version": "1", "state": "READY"}]
        assert all(e["uptime_s"] >= 0 for e in got.values())

        table = ps(run_dir).stdout
        assert table.splitlines()[0].split()[:3] == ["PID", "HTTP", "GRPC"]
        assert f"{a.proc.pid}  http://127.0.0.1:{a.port}" in table
        assert "affine:1 READY" in table and "pair:1 READY" in table

        # A model's state change reaches the entry.
        req = urllib.request.Request(a.base + "/v2/repository/models/affine/unload", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        wait_for(
            run_dir,
            lambda es: by_pid(es)[a.proc.pid]["models"][0]["state"] == "UNAVAILABLE",
        )

        assert a.stop(signal.SIGTERM) == 0
        assert not (run_dir / f"{a.proc.pid}.json").exists()  # removed by the server itself
        assert [e["pid"] for e in ps_json(run_dir)] == [b.proc.pid]

        b.stop(signal.SIGKILL)
        stale = run_dir / f"{b.proc.pid}.json"
        assert stale.exists()  # no chance to remove it
        assert ps_json(run_dir) == []
        assert not stale.exists()  # skipped and cleaned
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)


def test_entries_of_dead_or_reused_pids_are_skipped_and_deleted(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = os.getpid()
    entry = {"pid": me, "proc_start": runtime_dir.process_start_time(me), "started_at": 0.0}
    runtime_dir.write_entry(tmp_path, me, entry)
    # The pid of a process that exited, and a live pid that started at another time.
    runtime_dir.write_entry(tmp_path, gone.pid, {**entry, "pid": gone.pid})
    reused = os.getppid()
    runtime_dir.write_entry(tmp_path, reused, {**entry, "pid": reused, "proc_start": "1"})
    (tmp_path / f".{gone.pid}.tmp").write_text("{")  # a write cut short by a kill
    (tmp_path / "notes.txt").write_text("not ours")

    assert runtime_dir.live_entries(tmp_path) == [entry]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{me}.json", "notes.txt"]
    runtime_dir.remove_entry(tmp_path, me)
    assert runtime_dir.live_entries(tmp_path) == []


def test_runtime_dir_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASERVE_RUNTIME_DIR", str(tmp_path / "a"))
    assert runtime_dir.runtime_dir() == tmp_path / "a"
    monkeypatch.delenv("ASERVE_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert runtime_dir.runtime_dir() == tmp_path / "xdg" / "aserve"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime_dir.runtime_dir() == tmp_path / "home" / ".cache" / "aserve" / "run"


def test_a_server_is_listed_while_its_models_load(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copy(HANDLERS / "gated.py", tmp_path / "gated.py")
    gate, began = tmp_path / "gate", tmp_path / "began"
    os.mkfifo(gate)
    config = write_config(tmp_path, {"models": [{
        "name": "gated", "engine": "python", "handler": "gated:Gated",
        "parameters": {"gate": str(gate), "began": str(began)},
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
    }]})  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "ASERVE_RUNTIME_DIR": str(run_dir)},
    )  # fmt: skip
    try:
        entry = wait_for(run_dir, lambda es: bool(es) and began.exists())[0]
        assert entry["pid"] == proc.pid and entry["state"] == "starting"
        assert entry["models"] == [{"name": "gated", "version": "1", "state": "LOADING"}]
        assert entry["http"]  # listening already
        with open(gate, "wb"):  # lets load() return
            pass
        wait_for(
            run_dir, lambda es: es[0]["state"] == "ready" and es[0]["models"][0]["state"] == "READY"
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert ps_json(run_dir) == [] and not any(run_dir.iterdir())
    finally:
        proc.kill()
        proc.wait()
