"""Config hot reload on a real server: under load, rejected changes, SIGHUP."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from conftest import model_entry, spec, start_server
from helpers import v2_body
from models import _script_save
from reload_helpers import (
    config_status,
    copy_handler,
    get_json,
    rewrite_config,
    rewrite_raw,
    wait_attempts,
    wait_log,
    wait_status,
)

pytestmark = pytest.mark.timeout(180)

X = np.linspace(-1, 1, 16, dtype=np.float32)
A, B = np.arange(8, dtype=np.float32), np.ones(8, dtype=np.float32)


class Split(torch.nn.Module):
    """What 'morph' becomes: two outputs instead of affine's one."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1, keepdim=True)


def _affine(name: str, folder: Path, **extra: Any) -> dict[str, Any]:
    return model_entry(
        name, str(folder / "affine.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("OUTPUT0", "FP32", [16])], **extra,
    )  # fmt: skip


def _pair(folder: Path) -> dict[str, Any]:
    return model_entry(
        "pair", str(folder / "pair.pt2"), [spec("A", "FP32", [8]), spec("B", "FP32", [8])],
        [spec("SUM", "FP32", [8]), spec("DOT", "FP32", [1])],
    )  # fmt: skip


def _split(name: str, folder: Path) -> dict[str, Any]:
    return model_entry(
        name, str(folder / "split.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("DOUBLE", "FP32", [16]), spec("TOTAL", "FP32", [1])],
    )  # fmt: skip


class Load:
    """Steady requests against several models until stopped; every answer recorded."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.stop = asyncio.Event()
        self.answers: dict[str, list[tuple[float, int, dict[str, Any]]]] = {}

    async def worker(self, session: aiohttp.ClientSession, model: str, body: dict) -> None:
        url = f"{self.base}/v2/models/{model}/infer"
        answers = self.answers.setdefault(model, [])
        for _ in range(20_000):  # bounded even if the test forgets to stop it
            if self.stop.is_set():
                return
            sent = time.monotonic()
            async with session.post(url, json=body) as r:
                answers.append((sent, r.status, await r.json()))


@pytest.fixture
def folder(model_dir: Path, tmp_path: Path) -> Path:
    _script_save(Split(), tmp_path / "split.pt")
    return tmp_path


def test_config_changes_under_load_fail_no_request(model_dir, folder, eager_models):
    """Add, remove, change and re-batch models while two models take steady traffic."""
    base_models = [
        _affine("affine", model_dir, batching={"max_batch_size": 8, "max_delay_ms": 2.0}),
        _pair(model_dir),
        _affine("gone", model_dir),
        _affine("morph", model_dir),
    ]
    config: dict[str, Any] = {"grpc": {"port": 0}, "models": base_models}
    path = folder / "live.json"
    rewrite_config(path, config)
    server = start_server(path, extra_args=("--watch-interval", "0.1"))
    status0 = config_status(server.base)
    assert status0["config_file"] == str(path) and status0["last_reload"] is None
    steps: dict[str, float] = {}  # step -> the time its change was seen applied

    def apply(models: list[dict[str, Any]], changes: dict[str, list[str]], step: str) -> None:
        digest = rewrite_config(path, {**config, "models": models})
        status = wait_status(server.base, lambda s: s["config_hash"] == digest)
        assert status["last_reload"]["result"] == "ok", status
        assert status["last_reload"]["trigger"] == "file change"
        got = {k: v for k, v in status["last_reload"]["changes"].items() if v}
        assert got == changes, status
        steps[step] = time.monotonic()

    async def scenario() -> Load:
        load = Load(server.base)
        async with aiohttp.ClientSession() as session:
            bodies = {
                "affine": v2_body("INPUT0", X.tolist(), [1, 16]),
                "pair": {
                    "inputs": [
                        {"name": "A", "datatype": "FP32", "shape": [1, 8], "data": A.tolist()},
                        {"name": "B", "datatype": "FP32", "shape": [1, 8], "data": B.tolist()},
                    ]
                },
                "gone": v2_body("INPUT0", X.tolist(), [1, 16]),
                "morph": v2_body("INPUT0", X.tolist(), [1, 16]),
            }
            workers = [
                asyncio.create_task(load.worker(session, model, body))
                for model, body in bodies.items()
                for _ in range(2 if model in ("affine", "pair") else 1)
            ]
            try:
                # Let traffic reach every model before changing anything.
                await _until(lambda: all(len(load.answers.get(m, ())) >= 5 for m in bodies))
                models = list(base_models)
                models.append(_affine("extra", model_dir))
                await asyncio.to_thread(apply, models, {"added": ["extra/1"]}, "add")
                models = [m for m in models if m["name"] != "gone"]
                await asyncio.to_thread(apply, models, {"removed": ["gone/1"]}, "remove")
                models = [_split("morph", folder) if m["name"] == "morph" else m for m in models]
                await asyncio.to_thread(apply, models, {"replaced": ["morph/1"]}, "change")
                batching = {"max_batch_size": 8, "max_delay_ms": 0.5, "max_queue_size": 64,
                            "timeout_ms": 9000, "preferred_batch_sizes": [4]}  # fmt: skip
                models = [
                    {**m, "batching": batching} if m["name"] == "affine" else m for m in models
                ]
                await asyncio.to_thread(apply, models, {"reconfigured": ["affine/1"]}, "batching")
                # Some traffic after the last change, too.
                after = len(load.answers["affine"])
                await _until(lambda: len(load.answers["affine"]) >= after + 20)
            finally:
                load.stop.set()
                await asyncio.gather(*workers)
        return load

    try:
        load = asyncio.run(scenario())
        want_affine = eager_models["affine"](torch.from_numpy(X[None])).detach().numpy()
        for model in ("affine", "pair"):
            failed = [(status, doc) for _, status, doc in load.answers[model] if status != 200]
            assert not failed, f"{model}: {len(failed)} failed, e.g. {failed[:3]}"
        for _, _, doc in load.answers["affine"]:
            np.testing.assert_allclose(doc["outputs"][0]["data"], want_affine.ravel(), rtol=1e-5)
        # The removed model: answered until the swap, 404 for anything sent after it.
        for sent, status, doc in load.answers["gone"]:
            assert status in (200, 404), doc
            if sent > steps["remove"]:
                assert (
                    status == 404
                    and "Request for unknown model: 'gone' is not found" in doc["error"]
                ), doc
        assert any(s == 200 for _, s, _ in load.answers["gone"])
        # The changed model: never an error; the new outputs for anything sent after the swap.
        new_seen = 0
        for sent, status, doc in load.answers["morph"]:
            assert status == 200, doc
            names = [o["name"] for o in doc["outputs"]]
            if names == ["DOUBLE", "TOTAL"]:
                new_seen += 1
                np.testing.assert_allclose(doc["outputs"][0]["data"], X * 2, rtol=1e-6)
                np.testing.assert_allclose(doc["outputs"][1]["data"], [X.sum()], rtol=1e-5)
            else:
                assert names == ["OUTPUT0"] and sent < steps["change"], doc
        assert new_seen > 0
        # Added model serves; in-place batching kept affine's runtime (and its statistics).
        status, doc = get_json(f"{server.base}/v2/models/extra")
        assert status == 200 and doc["name"] == "extra"
        status, stats = get_json(f"{server.base}/v2/models/affine/stats")
        assert stats["model_stats"][0]["inference_count"] >= len(load.answers["affine"])
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(server.grpc_url)
        cfg = client.get_model_config("affine").config
        client.close()
        assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
        assert cfg.parameters["max_queue_size"].string_value == "64"
        final = config_status(server.base)
        assert final["reloads"] == {"ok": 4, "rejected": 0, "unchanged": 0}
        assert final["last_error"] is None
        assert {(m["name"], m["state"]) for m in final["models"]} == {
            ("affine", "READY"), ("pair", "READY"), ("morph", "READY"), ("extra", "READY"),
        }  # fmt: skip
        wait_log(server, "model gone/1 drained and unloaded")
        wait_log(server, "model morph/1 drained and unloaded")
    finally:
        assert server.stop() == 0


def test_rejected_configs_keep_the_old_one_and_sighup_reloads(model_dir, folder):
    """With watching off, SIGHUP is what applies a change; bad ones change nothing."""
    copy_handler(folder)
    good = {"models": [_affine("affine", model_dir)]}
    path = folder / "hup.json"
    first = rewrite_config(path, good)
    server = start_server(path, extra_args=("--watch-interval", "0"))
    url = f"{server.base}/v2/models/affine/infer"
    body = v2_body("INPUT0", X.tolist(), [1, 16])

    def hup_and_wait() -> dict[str, Any]:
        before = config_status(server.base)["reloads"]
        server.proc.send_signal(signal.SIGHUP)
        return wait_attempts(server.base, before)

    def assert_rejected(status: dict[str, Any], *fragments: str) -> None:
        assert status["last_reload"]["result"] == "rejected", status
        assert status["last_reload"]["trigger"] == "SIGHUP"
        for fragment in fragments:
            assert fragment in status["last_error"]["error"], status
        assert status["config_hash"] == first  # the old config stays in force
        answer = asyncio.run(_post(url, body))
        assert answer[0] == 200, answer

    (folder / "broken.pt").write_bytes(b"this is not a TorchScript file")
    try:
        # Watching is off: a changed file alone changes nothing.
        rewrite_config(path, {"models": [*good["models"], _affine("late", model_dir)]})
        assert get_json(f"{server.base}/v2/models/late")[0] == 404
        status = hup_and_wait()
        assert (
            status["last_reload"]["result"] == "ok" and status["last_reload"]["trigger"] == "SIGHUP"
        )
        assert status["last_reload"]["changes"]["added"] == ["late/1"]
        assert get_json(f"{server.base}/v2/models/late")[0] == 200
        first = rewrite_config(path, good)
        status = hup_and_wait()
        assert status["config_hash"] == first and status["last_reload"]["changes"]["removed"] == [
            "late/1"
        ]

        rewrite_raw(path, b'{"models": [')
        assert_rejected(hup_and_wait(), "invalid JSON")
        bad = {"models": [_affine("affine", model_dir, batching={"max_batch_size": 0})]}
        rewrite_config(path, bad)
        assert_rejected(hup_and_wait(), "models[0].batching.max_batch_size: must be >= 1")
        broken = model_entry(
            "broken", "broken.pt", [spec("X", "FP32", [1])], [spec("Y", "FP32", [1])]
        )
        rewrite_config(path, {"models": [good["models"][0], broken]})
        assert_rejected(hup_and_wait(), "models[1]: model 'broken/1' failed to load")
        assert get_json(f"{server.base}/v2/models/broken")[0] == 404
        missing = {**broken, "path": "nowhere.pt"}
        rewrite_config(path, {"models": [good["models"][0], missing]})
        assert_rejected(hup_and_wait(), "models[1].path: file not found")
        handler = {
            "name": "tok", "engine": "python", "handler": "text_tokenizer:NotAHandler",
            "inputs": [spec("TEXT", "BYTES", [1])], "outputs": [spec("IDS", "FP32", [16])],
        }  # fmt: skip
        rewrite_config(path, {"models": [good["models"][0], handler]})
        assert_rejected(
            hup_and_wait(), "models[1].handler: class 'text_tokenizer:NotAHandler' lacks method(s) "
            "preprocess, infer, postprocess",
        )  # fmt: skip
        rewrite_config(path, {"models": [good["models"][0], {**handler, "handler": "nope:X"}]})
        assert_rejected(hup_and_wait(), "models[1].handler: cannot import module 'nope'")
        assert "config reload (SIGHUP) rejected" in server.log_text()
        assert "models[1].handler: cannot import module 'nope'" in server.log_text()

        # Listener settings are reported as needing a restart, the rest applies.
        restart = {"http": {"port": 9}, "limits": {"max_request_bytes": 1000}, **good}
        digest = rewrite_config(path, restart)
        status = hup_and_wait()
        assert status["last_reload"]["result"] == "ok" and status["config_hash"] == digest
        assert status["restart_required"] == [
            "http.port: 8000 -> 9 (needs a restart)",
            "limits.max_request_bytes: 67108864 -> 1000 (needs a restart)",
        ]
        assert status["reloads"] == {"ok": 3, "rejected": 6, "unchanged": 0}
        assert "needs a restart to take effect: http.port" in server.log_text()
        # SIGHUP with nothing changed.
        status = hup_and_wait()
        assert status["last_reload"]["result"] == "unchanged"
    finally:
        assert server.stop() == 0


async def _until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()
