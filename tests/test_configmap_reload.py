"""Config reload from a Kubernetes ConfigMap volume, under load.

The config file is a symlink through ``..data`` into a timestamped folder that the
next update deletes (see ``configmap_dir.py``); relative paths (here: the handler
module, shipped in the same ConfigMap) must keep resolving against the mount
folder, and every update must be seen and applied, while traffic never fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from configmap_dir import ConfigMapDir
from conftest import HANDLERS, model_entry, spec, start_server
from helpers import v2_body
from reload_helpers import config_status, get_json, wait_status

pytestmark = pytest.mark.timeout(180)

SWAPS = 4
X = np.linspace(-1, 1, 16, dtype=np.float32)


def _config(model_dir: Path, version: int) -> dict[str, Any]:
    """Version ``version`` of the config: affine's max_delay_ms differs in each, and
    the model ``extra`` is there in every other one."""
    handler = {
        "engine": "python", "handler": "sleeper:Sleeper", "parameters": {"sleep_ms": 0},
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
    }  # fmt: skip
    models = [
        model_entry(
            "affine", str(model_dir / "affine.pt"),
            [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
            batching={"max_batch_size": 8, "max_delay_ms": 1.0 + version},
        ),
        {"name": "words", **handler},
    ]  # fmt: skip
    if version % 2:
        models.append({"name": "extra", **handler})
    return {"grpc": {"port": 0}, "models": models}


def _files(model_dir: Path, version: int) -> dict[str, bytes]:
    return {
        "config.json": json.dumps(_config(model_dir, version), indent=2).encode(),
        "sleeper.py": (HANDLERS / "sleeper.py").read_bytes(),
    }


def test_configmap_updates_apply_under_load_and_fail_nothing(model_dir, tmp_path):
    configmap = ConfigMapDir(tmp_path / "etc-aserve")
    configmap.write(_files(model_dir, 0))
    path = configmap.mount / "config.json"
    server = start_server(path, extra_args=("--watch-interval", "0.1"))
    answers: dict[str, list[tuple[int, Any]]] = {"affine": [], "words": []}
    stop = asyncio.Event()

    async def worker(session: aiohttp.ClientSession, model: str, body: dict) -> None:
        for _ in range(50_000):  # bounded even if the test never stops it
            if stop.is_set():
                return
            try:
                async with session.post(f"{server.base}/v2/models/{model}/infer", json=body) as r:
                    answers[model].append((r.status, await r.json()))
            except aiohttp.ClientError as exc:
                answers[model].append((0, repr(exc)))

    def swap(version: int) -> None:
        configmap.write(_files(model_dir, version))
        assert len(configmap.timestamped()) == 1  # the old version's folder is gone
        status = wait_status(
            server.base,
            lambda s: s["reloads"]["ok"] + s["reloads"]["rejected"] >= version,
        )
        assert status["last_reload"]["result"] == "ok", status
        assert status["last_error"] is None, status
        changes = {k: v for k, v in status["last_reload"]["changes"].items() if v}
        extra = {"added": ["extra/1"]} if version % 2 else {"removed": ["extra/1"]}
        assert changes == {"reconfigured": ["affine/1"], **extra}, status
        # The change is visible through the API.
        code, _ = get_json(f"{server.base}/v2/models/extra/ready")
        assert code == (200 if version % 2 else 404)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            batching = client.get_model_config("affine").config.dynamic_batching
        finally:
            client.close()
        assert batching.max_queue_delay_microseconds == int((1.0 + version) * 1000)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            workers = [
                asyncio.create_task(
                    worker(session, "affine", v2_body("INPUT0", X.tolist(), [1, 16]))
                ),
                asyncio.create_task(worker(session, "words", v2_body("X", [1.0, 2.0], [1, 2]))),
            ]
            try:
                await _until(lambda: all(len(a) >= 5 for a in answers.values()))
                for version in range(1, SWAPS + 1):
                    before = {m: len(a) for m, a in answers.items()}
                    await asyncio.to_thread(swap, version)
                    # Traffic keeps flowing after each swap, too.
                    await _until(lambda b=before: all(len(answers[m]) >= b[m] + 5 for m in b))
            finally:
                stop.set()
                await asyncio.gather(*workers)

    try:
        asyncio.run(scenario())
        for model, got in answers.items():
            failed = [a for a in got if a[0] != 200]
            assert not failed, f"{model}: {len(failed)} of {len(got)} failed, e.g. {failed[:3]}"
        assert all(doc["outputs"][0]["data"] == [3.0] for _, doc in answers["words"])
        final = config_status(server.base)
        assert final["reloads"] == {"ok": SWAPS, "rejected": 0, "unchanged": 0}, final
        assert final["config_file"] == str(path)
    finally:
        assert server.stop() == 0


async def _until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_a_swapped_in_file_is_a_change_even_with_the_same_size_and_mtime(tmp_path):
    """A ConfigMap update may bring a file of the same size (one value changed) whose
    mtime matches the old one's (a copy that kept it): the inode still tells them apart."""
    from aserve.config import read_config
    from aserve.loop.reload import _fingerprint

    configmap = ConfigMapDir(tmp_path / "etc-aserve")
    configmap.write({"config.json": b'{"drain_timeout_s": 1}'})
    path = configmap.mount / "config.json"
    before = _fingerprint(path)
    stat = path.stat()
    configmap.write({"config.json": b'{"drain_timeout_s": 2}'})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert _fingerprint(path) != before
    # Relative paths resolve against the mount folder, which outlives every update.
    assert read_config(path)[1] == configmap.mount
