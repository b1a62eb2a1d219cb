"""Starting, configuring and stopping the real server process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest
from conftest import model_entry, spec, start_server, write_config
from helpers import frozen, v2_body, wait_for_stats
from reload_helpers import wait_log


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args], capture_output=True, text=True, timeout=timeout
    )


def _affine_entry(**batching):
    return model_entry(
        "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
        **({"batching": batching} if batching else {}),
    )  # fmt: skip


BAD_CONFIGS = [
    ({"models": [_affine_entry(max_batch_size=0)]}, "models[0].batching.max_batch_size: must be >= 1"),
    ({"models": [{**_affine_entry(), "colour": "red"}]}, "models[0].colour: unknown key"),
    ({"models": [{**_affine_entry(), "device": "tpu"}]}, "models[0].device: 'tpu' is not a device"),
    ({"models": [{**_affine_entry(), "path": "missing.pt"}]}, "models[0].path: file not found"),
    ({"models": [_affine_entry(max_batch_size=4, preferred_batch_sizes=[8])]},
     "models[0].batching: preferred_batch_sizes: 8 must be between 1 and max_batch_size (4)"),
    ({"models": [{k: v for k, v in _affine_entry().items() if k != "inputs"}]},
     "models[0].inputs: required with engine 'torch'"),
    ({"http": {"port": 70000}}, "http.port: must be <= 65535"),
    ({"grpc": {"port": 70000}}, "grpc.port: must be <= 65535"),
    ({"models": [_affine_entry(), _affine_entry()]}, "model 'affine' version '1' is configured twice"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_exits_2_naming_the_json_path(model_dir, tmp_path, config, message):
    # Relative model paths resolve against the config's folder: keep it beside the models.
    path = write_config(model_dir, config, name=f"bad-{tmp_path.name}.json")
    result = _run_cli("--config", str(path))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_config_that_is_not_json_exits_2(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"models": [')
    result = _run_cli("--config", str(path))
    assert result.returncode == 2
    assert "invalid JSON" in result.stderr and "Traceback" not in result.stderr


def test_model_that_fails_to_load_exits_1_with_the_reason(model_dir, tmp_path):
    entry = _affine_entry()
    entry["outputs"] = [spec("OUTPUT0", "FP64", [16])]  # the model returns FP32
    path = write_config(model_dir, {"models": [entry]}, name=f"dtype-{tmp_path.name}.json")
    result = _run_cli("--config", str(path))
    assert result.returncode == 1
    assert "affine/1" in result.stderr and "FP64" in result.stderr


def test_default_config_serves_the_builtin_model(tmp_path):
    """What the quick start's first command does: no --config, the embedded default."""
    env = {**os.environ, "ASERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--port", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        port, lines = None, []
        deadline = time.monotonic() + 60
        assert proc.stderr is not None
        ready = False
        while not ready and time.monotonic() < deadline:  # listening, then loading: ready
            line = proc.stderr.readline()
            lines.append(line)
            if "listening on http://" in line:
                port = int(line.rsplit(":", 1)[1])
            ready = "ready: 1 model(s) serving" in line
        assert port is not None and ready, "".join(lines)
        assert any("model affine/1 loaded" in line for line in lines)
        x = np.arange(16, dtype=np.float32)

        async def call():
            async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{port}/v2/models/affine/infer",
                json=v2_body("INPUT0", x.tolist(), [1, 16]),
            ) as r:  # fmt: skip
                return r.status, await r.json()

        status, body = asyncio.run(call())
        assert status == 200
        # The builtin model is built from seed 0; rebuild it here the same way.
        import torch

        from aserve.engines.builtin import affine

        want = affine()(torch.from_numpy(x[None])).detach().numpy().ravel()
        np.testing.assert_allclose(body["outputs"][0]["data"], want, rtol=1e-5, atol=1e-5)
        assert list((tmp_path / "cache" / "builtin").glob("affine-*.pt"))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_sigterm_lets_in_flight_requests_finish(model_dir, tmp_path):
    entry = model_entry(
        "spin", "spin.pt", [spec("X", "FP32", [-1])], [spec("Y", "FP32", [1])],
        batching={"max_batch_size": 4, "timeout_ms": 60000}, executor="process",
    )  # fmt: skip
    config = write_config(model_dir, {"models": [entry], "drain_timeout_s": 60},
                          name=f"drain-{tmp_path.name}.json")  # fmt: skip
    server = start_server(config)

    async def scenario():
        url = f"{server.base}/v2/models/spin/infer"
        async with aiohttp.ClientSession() as s:
            # The worker is frozen until the server is draining: the first request runs,
            # and the others (different widths cannot share a batch) queue behind it.
            widths = [2, 3, 4, 5, 6]
            with frozen(server.worker_pid("spin")):
                tasks = [
                    asyncio.create_task(s.post(url, json=v2_body("X", [1.0] * w, [1, w])))
                    for w in widths
                ]
                await wait_for_stats(
                    s, server.base, "spin",
                    lambda st: st["pending_request_count"] + st["running_batch_count"]
                    == len(widths),
                )  # fmt: skip
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(wait_log, server, "SIGTERM received: draining")
            responses = await asyncio.gather(*tasks)
            out = []
            for w, r in zip(widths, responses, strict=True):
                out.append((w, r.status, await r.json()))
                r.release()
            return out

    try:
        results = asyncio.run(scenario())
        for width, status, body in results:
            assert status == 200, body
            assert body["outputs"][0]["data"] == [float(width)]
        assert server.proc.wait(30) == 0
        log = server.log_text()
        assert "SIGTERM received: draining" in log and "stopped" in log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_config_json_path_is_relative_to_its_folder(model_dir, tmp_path):
    # A config elsewhere pointing back at the models with a relative path.
    sub = tmp_path / "conf"
    sub.mkdir()
    rel = os.path.relpath(model_dir / "affine.pt", sub)
    entry = {**_affine_entry(), "path": rel}
    (sub / "c.json").write_text(json.dumps({"models": [entry]}))
    server = start_server(sub / "c.json")
    try:
        assert "model affine/1 loaded" in server.log_text()
    finally:
        assert server.stop() == 0
