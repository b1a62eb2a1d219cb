"""``aserve ps``: real servers register in the runtime directory; the command lists them.

Servers run with ``ASERVE_RUNTIME_DIR`` in a temporary folder. A server
stopped by SIGTERM removes its entry; one killed by SIGKILL leaves it, and
``ps`` skips and deletes it, as it does an entry whose pid now belongs to
another process (pid reuse).
"""

from __future__ import annotations

import json
import os
import resource
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

    assert runtime_dir.live_entries(tmp_path) == runtime_dir.Listing([entry], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{me}.json", "notes.txt"]
    runtime_dir.remove_entry(tmp_path, me)
    assert runtime_dir.live_entries(tmp_path).entries == []


def test_runtime_dir_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASERVE_RUNTIME_DIR", str(tmp_path / "a"))
    assert runtime_dir.runtime_dir() == tmp_path / "a"
    monkeypatch.delenv("ASERVE_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert runtime_dir.runtime_dir() == tmp_path / "xdg" / "aserve"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert runtime_dir.runtime_dir() == tmp_path / "cache" / "run"  # it follows the cache
    monkeypatch.delenv("ASERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime_dir.runtime_dir() == tmp_path / "home" / ".cache" / "aserve" / "run"


def test_the_entry_says_ready_once_the_log_does(model_dir: Path, tmp_path: Path) -> None:
    """No look a poll later: the entry is written before the "ready" log line,
    which also names the dashboard."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path, {"models": [
        model_entry("affine", str(model_dir / "affine.pt"),
                    [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])]),
    ]})  # fmt: skip
    srv = start_server(config, extra_env={"ASERVE_RUNTIME_DIR": str(run_dir)})
    try:
        deadline = time.monotonic() + 60
        while "ready: 1 model(s) serving" not in srv.log_text():
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.05)
        assert f"dashboard: http://127.0.0.1:{srv.port}/" in srv.log_text()
        entry = by_pid(runtime_dir.live_entries(run_dir).entries)[srv.proc.pid]
        assert entry["state"] == "ready"
        assert entry["models"] == [{"name": "affine", "version": "1", "state": "READY"}]
    finally:
        srv.stop()


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


# --- a runtime directory others could write to, and files that are not entries -------


def ps_bounded(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``aserve ps`` with its memory capped: a runtime directory's files must not make it
    read without end (a link to /dev/zero) or wait for ever (a FIFO)."""

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {**os.environ, "ASERVE_RUNTIME_DIR": str(folder)}
    return subprocess.run(
        [sys.executable, "-m", "aserve", "ps", *args], capture_output=True, text=True,
        timeout=60, env=env, preexec_fn=cap_memory,
    )  # fmt: skip


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # whatever the umask
    return path


def test_a_planted_symlink_is_replaced_never_followed(tmp_path: Path) -> None:
    run_dir = private_dir(tmp_path / "run")
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.write_text("precious\n")
    victim2.write_text("precious too\n")
    me = os.getpid()
    (run_dir / f".{me}.tmp").symlink_to(victim)  # where the entry is written first
    (run_dir / f"{me}.json").symlink_to(victim2)  # and the name it is renamed to
    entry = {"pid": me, "proc_start": runtime_dir.process_start_time(me), "started_at": 0.0}

    runtime_dir.write_entry(run_dir, me, entry)

    assert victim.read_text() == "precious\n" and victim2.read_text() == "precious too\n"
    written = run_dir / f"{me}.json"
    assert not written.is_symlink() and json.loads(written.read_text()) == entry
    assert written.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in run_dir.iterdir()) == [f"{me}.json"]


def test_a_runtime_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    me = os.getpid()
    entry = {"pid": me, "proc_start": runtime_dir.process_start_time(me), "started_at": 0.0}
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o1777, 0o770):  # world, world with the sticky bit, group
        shared.chmod(mode)
        with pytest.raises(runtime_dir.UnsafeRuntimeDir) as refused:
            runtime_dir.write_entry(shared, me, entry)
        assert str(refused.value) == (
            f"runtime directory {shared} may be written by other users (mode {mode:04o}): "
            f"run chmod 700 {shared}, or set ASERVE_RUNTIME_DIR to a directory of your own "
            "with mode 700"
        )
        done = ps_bounded(shared)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr == f"aserve ps: error: {refused.value}\n"
    assert list(shared.iterdir()) == []

    # A link to a private directory is not taken for the directory itself.
    target = private_dir(tmp_path / "target")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(runtime_dir.UnsafeRuntimeDir, match=f"{link} is a symlink: set"):
        runtime_dir.write_entry(link, me, entry)
    assert "is a symlink" in ps_bounded(link).stderr and list(target.iterdir()) == []

    if os.geteuid() == 0:  # only root can give a directory to another user
        theirs = private_dir(tmp_path / "theirs")
        os.chown(theirs, 4321, 4321)
        with pytest.raises(runtime_dir.UnsafeRuntimeDir, match="belongs to uid 4321, not to"):
            runtime_dir.write_entry(theirs, me, entry)
        assert "belongs to uid 4321" in ps_bounded(theirs).stderr


def test_a_server_does_not_register_in_a_directory_others_can_write(
    model_dir: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    srv = start_server(
        None,
        extra_env={"ASERVE_RUNTIME_DIR": str(shared)},
        argv=["serve", str(model_dir / "pair.pt2"), "--port", "0", "--no-grpc"],
    )
    try:
        want = f"cannot register in {shared} (aserve ps): runtime directory {shared} may be written"
        deadline = time.monotonic() + 30
        while want not in srv.log_text():
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.05)
        assert list(shared.iterdir()) == []  # nothing written there, and serving goes on
        with urllib.request.urlopen(srv.base + "/v2/health/ready", timeout=10) as r:
            assert r.status == 200
    finally:
        assert srv.stop(signal.SIGTERM) == 0


def test_ps_skips_files_that_are_not_entries_and_says_so(tmp_path: Path) -> None:
    run_dir = private_dir(tmp_path / "run")
    me = os.getpid()
    entry = {"pid": me, "proc_start": runtime_dir.process_start_time(me), "started_at": 0.0,
             "models": [{"name": "m", "version": "1", "state": "READY"}]}  # fmt: skip
    runtime_dir.write_entry(run_dir, me, entry)
    # Named like entries of running processes (pid 1 and this test's parent run for
    # as long as the test), so none is taken for a stale entry and deleted.
    parent = os.getppid()
    os.mkfifo(run_dir / "1.json")  # opening it to read would wait for a writer
    (run_dir / f"{parent}.json").symlink_to("/dev/zero")  # endless
    big = run_dir / "2.json"
    with big.open("wb") as f:
        f.truncate(runtime_dir.MAX_ENTRY_BYTES + 1)
    done = ps_bounded(run_dir, "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [{k: v for k, v in e.items() if k != "uptime_s"} for e in listed] == [entry]
    assert sorted(done.stderr.splitlines()) == sorted(
        [
            f"aserve ps: skipped {run_dir}/1.json: not a regular file (a FIFO)",
            f"aserve ps: skipped {run_dir}/2.json: {runtime_dir.MAX_ENTRY_BYTES + 1} bytes, "
            f"over the {runtime_dir.MAX_ENTRY_BYTES} an entry may have",
            f"aserve ps: skipped {run_dir}/{parent}.json: a symlink, not an entry",
        ]
    )
    # JSON of the wrong shape, in the entries of running processes: skipped, not a crash.
    for path in (run_dir / "1.json", run_dir / f"{parent}.json"):
        path.unlink()
    (run_dir / "1.json").write_text(json.dumps({**entry, "pid": 1, "models": 5}))
    (run_dir / f"{parent}.json").write_bytes(b"[1, 2]")
    done = ps_bounded(run_dir)
    assert done.returncode == 0, done.stderr
    assert "m:1 READY" in done.stdout
    assert sorted(done.stderr.splitlines()) == sorted([
        f"aserve ps: skipped {run_dir}/1.json: not an entry: models: Input should be a valid list",
        f"aserve ps: skipped {run_dir}/{parent}.json: not an entry: a JSON list, not an object",
        f"aserve ps: skipped {run_dir}/2.json: {runtime_dir.MAX_ENTRY_BYTES + 1} bytes, "
        f"over the {runtime_dir.MAX_ENTRY_BYTES} an entry may have",
    ])  # fmt: skip
    # What was skipped is left there: it is no stale entry of a server that is gone.
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["1.json", "2.json", f"{parent}.json", f"{me}.json"]
    )
