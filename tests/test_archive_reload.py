"""An archive replaced in place on a running server: SIGHUP and the repository API's
``load`` serve the new content (archives are keyed by their digest, not their path),
and the cache keeps only the extractions some model still uses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from archive_helpers import ROWS, digest, env, folders, pack, relabelled, scaffold
from conftest import ServerProcess, start_server, write_config
from helpers import v2_body
from reload_helpers import config_status, rewrite_config, wait_attempts

from aserve.config import archive_cache

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scaffold packed twice: as made ("setosa") and with its first label renamed."""
    work = tmp_path_factory.mktemp("archives")
    project = scaffold(work)
    return {
        "setosa": pack(project, work / "v1.aserve"),
        "SETOSA-v2": pack(relabelled(project, work, "SETOSA-v2"), work / "v2.aserve"),
        "third": pack(relabelled(project, work, "third"), work / "v3.aserve"),
    }


def swap_in(src: Path, dst: Path) -> None:
    """Replace ``dst`` in one step, as a deploy does (write beside, rename)."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


async def first_label(server: ServerProcess, model: str = "iris") -> str:
    body = v2_body("FEATURES", ROWS[:4], [1, 4])
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.base}/v2/models/{model}/infer", json=body) as r:
            answer = await r.json()
    assert r.status == 200, answer
    (label,) = next(o for o in answer["outputs"] if o["name"] == "LABEL")["data"]
    return str(label)


def wait_folders(cache: Path, want: list[str], timeout: float = 60.0) -> None:
    """Poll the cache until it holds exactly ``want`` (sweeps run after drains)."""
    deadline = time.monotonic() + timeout
    while folders(cache) != sorted(want):
        if time.monotonic() > deadline:
            raise AssertionError(f"the cache holds {folders(cache)}, not {sorted(want)}")
        time.sleep(0.05)


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_an_archive_replaced_in_place_is_served_after_sighup_and_load(
    executor: str, archives: dict[str, Path], tmp_path: Path
) -> None:
    served = tmp_path / "iris.aserve"
    shutil.copy(archives["setosa"], served)
    cache = tmp_path / "cache"
    config = write_config(tmp_path, {"models": [
        {"name": "iris", "path": "iris.aserve", "executor": executor},
    ]})  # fmt: skip
    server = start_server(
        config, extra_env={"ASERVE_CACHE_DIR": str(cache)}, extra_args=("--watch-interval", "0")
    )
    try:
        assert await first_label(server) == "setosa"
        # SIGHUP with nothing changed: unchanged, the archive read again by content.
        before = config_status(server.base)["reloads"]
        server.proc.send_signal(signal.SIGHUP)
        status = wait_attempts(server.base, before)
        assert status["last_reload"]["result"] == "unchanged", status["last_reload"]

        # The archive swapped in place; the config file's bytes are the same.
        swap_in(archives["SETOSA-v2"], served)
        before = status["reloads"]
        server.proc.send_signal(signal.SIGHUP)
        status = wait_attempts(server.base, before)
        assert status["last_reload"]["result"] == "ok", status["last_reload"]
        assert status["last_reload"]["changes"]["replaced"] == ["iris/1"], status["last_reload"]
        assert await first_label(server) == "SETOSA-v2"
        # The old content's extraction goes once the old runtime has drained.
        wait_folders(cache, [digest(archives["SETOSA-v2"])])

        # Swapped again; the repository API's load reads it anew too.
        swap_in(archives["third"], served)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.base}/v2/repository/models/iris/load") as r:
                assert r.status == 200, await r.text()
        assert await first_label(server) == "third"
        status = config_status(server.base)
        assert status["last_reload"]["changes"]["replaced"] == ["iris/1"], status["last_reload"]
        wait_folders(cache, [digest(archives["third"])])
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()


async def test_removing_an_archive_model_removes_its_extraction(
    archives: dict[str, Path], tmp_path: Path
) -> None:
    shutil.copy(archives["setosa"], tmp_path / "iris.aserve")
    shutil.copy(archives["third"], tmp_path / "other.aserve")
    cache = tmp_path / "cache"
    # An unused extraction from an earlier run, and one an extraction that died left.
    stale = cache / "archives" / ("0" * 64)
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "f").write_bytes(b"x")
    (cache / "archives" / f".{'1' * 64}.1234.abcd").mkdir()
    models = [{"name": "iris", "path": "iris.aserve"}]
    config = write_config(tmp_path, {"models": models})
    server = start_server(
        config, extra_env={"ASERVE_CACHE_DIR": str(cache)}, extra_args=("--watch-interval", "0")
    )
    try:
        # At startup: what no model uses is removed, what this server serves stays.
        wait_folders(cache, [digest(archives["setosa"])])
        assert not any(p.name.startswith(".") for p in (cache / "archives").iterdir())

        before = config_status(server.base)["reloads"]
        rewrite_config(config, {"models": [{"name": "other", "path": "other.aserve"}]})
        server.proc.send_signal(signal.SIGHUP)
        status = wait_attempts(server.base, before)
        assert status["last_reload"]["changes"]["removed"] == ["iris/1"], status["last_reload"]
        wait_folders(cache, [digest(archives["third"])])

        # Unloaded through the repository API, the model stays in the config in force
        # (a load brings it back): its extraction stays too.
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.base}/v2/repository/models/other/unload") as r:
                assert r.status == 200
            async with session.post(f"{server.base}/v2/repository/models/other/load") as r:
                assert r.status == 200
        assert await first_label(server, "other") == "third"

        before = config_status(server.base)["reloads"]
        rewrite_config(config, {"models": []})
        server.proc.send_signal(signal.SIGHUP)
        wait_attempts(server.base, before)
        wait_folders(cache, [])
    finally:
        server.stop()


async def test_a_server_never_removes_what_another_server_serves(
    archives: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    extra = {"ASERVE_CACHE_DIR": str(cache)}
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    for folder, which in ((first_dir, "setosa"), (second_dir, "third")):
        folder.mkdir()
        shutil.copy(archives[which], folder / "iris.aserve")
        write_config(folder, {"models": [{"name": "iris", "path": "iris.aserve"}]})
    first = start_server(first_dir / "config.json", extra, ("--watch-interval", "0"))
    second = None
    try:
        # The second server's startup sweep finds the first one's folder held.
        second = start_server(second_dir / "config.json", extra, ("--watch-interval", "0"))
        both = [digest(archives["setosa"]), digest(archives["third"])]
        before = config_status(second.base)["reloads"]
        second.proc.send_signal(signal.SIGHUP)  # and sweeps again
        wait_attempts(second.base, before)
        assert folders(cache) == sorted(both)
        assert await first_label(first) == "setosa" and await first_label(second) == "third"
        # Once the first server is gone (its locks with it), the next sweep removes its folder.
        assert first.stop() == 0
        before = config_status(second.base)["reloads"]
        second.proc.send_signal(signal.SIGHUP)
        wait_attempts(second.base, before)
        wait_folders(cache, [digest(archives["third"])])
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_process_holding_an_extraction_keeps_it_until_it_exits(
    archives: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(cache))
    code = (
        "import sys; from pathlib import Path; from aserve.config.archive import serve_config\n"
        "serve_config(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(archives["setosa"])], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=env(ASERVE_CACHE_DIR=str(cache)),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert archive_cache.keep_only([]) == []  # held by the other process: kept
        assert folders(cache) == [digest(archives["setosa"])]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    assert archive_cache.keep_only([]) == [digest(archives["setosa"])]
    assert folders(cache) == [] and not list((cache / "archives").iterdir())
