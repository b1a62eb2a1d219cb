"""A shared device on a real server: one slot for two models, the next batch chosen
by deadline and priority, the priority parameter over HTTP and gRPC.

The models are python handlers (``handlers/turnstile.py``) whose batches wait
for the test to open a gate, and log in the order they ran; the test waits for
the server's own state (the device's waiting batchers) before it lets a batch
end, so every order below is the scheduler's, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from conftest import HANDLERS
from inprocess import in_process
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(120)


def _model(name: str, folder: Path, **batching: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "turnstile:Turnstile",
        "parameters": {"name": name, "log": str(folder / "ran.log"), "gates": str(folder)},
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
        "batching": {"max_batch_size": 1, "max_delay_ms": 0, "timeout_ms": 60_000, **batching},
    }  # fmt: skip


def _body(x: float, **parameters: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1],
                                        "data": [x]}]}  # fmt: skip
    if parameters:
        body["parameters"] = parameters
    return body


class _Gates:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log = folder / "ran.log"

    def ran(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    async def until_ran(self, n: int) -> None:
        await _until(lambda: len(self.ran()) >= n)

    def open(self, n: int) -> None:
        (self.folder / f"open-{n}").touch()


class _Http:
    """POSTs to the server, each answer as (status, JSON body)."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self._session = session
        self._base = base

    async def post(
        self, path: str, body: dict[str, Any], timeout_ms: int | None = None
    ) -> tuple[int, Any]:
        headers = {} if timeout_ms is None else {"aserve-timeout-ms": str(timeout_ms)}
        async with self._session.post(self._base + path, json=body, headers=headers) as r:
            return r.status, await r.json()

    async def get(self, path: str) -> Any:
        async with self._session.get(self._base + path) as r:
            return await r.json()


def _pending(srv: Any, model: str) -> int:
    """Requests the model's queue holds, as its statistics say."""
    return srv.server.registry.get(model).statistics()["pending_request_count"]


async def _until(condition: Any, timeout: float = 60.0) -> None:
    """Wait for ``condition()``: the server's state, or a line the handler wrote."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.005)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    shutil.copy(HANDLERS / "turnstile.py", tmp_path / "turnstile.py")
    return tmp_path


async def test_one_slot_two_models_earliest_deadline_first_over_http(folder: Path) -> None:
    config = {
        "devices": {"cpu": {"scheduling": "shared", "slots": 1}},
        "models": [_model("a", folder), _model("b", folder)],
    }
    gates = _Gates(folder)
    async with in_process(config, folder) as srv, aiohttp.ClientSession() as session:
        http = _Http(session, srv.base)
        device = srv.server.devices.shared["cpu"]

        async def infer(model: str, x: float, timeout_ms: int) -> tuple[int, Any]:
            return await http.post(f"/v2/models/{model}/infer", _body(x), timeout_ms)

        first = asyncio.ensure_future(infer("a", 1, 60_000))
        await gates.until_ran(1)  # a's batch holds the one slot
        later = asyncio.ensure_future(infer("b", 2, 50_000))
        await _until(lambda: device.waiting == 1)
        sooner = asyncio.ensure_future(infer("a", 3, 40_000))
        await _until(lambda: _pending(srv, "a") == 1)
        for n in (1, 2, 3):
            gates.open(n)
        answers = await asyncio.gather(first, later, sooner)
        assert [status for status, _ in answers] == [200, 200, 200]
        # a's second request (40 s left) before b's (50 s), though b asked first.
        assert gates.ran() == ["a 1", "a 3", "b 2"]
        assert device.batches == {"a/1": 2, "b/1": 1}
        stats = await http.get("/v2/dashboard/stats")
        (shown,) = stats["devices"]
        assert shown["name"] == "cpu" and shown["slots"] == 1 and shown["busy"] == 0
        assert [row[0] for row in shown["timeline"]] == ["a/1", "a/1", "b/1"]
        async with session.get(srv.base + "/metrics") as r:
            text = await r.text()
        assert 'aserve_device_batches_total{device="cpu",model="a/1"} 2.0' in text
        assert 'aserve_device_slots{device="cpu"} 1.0' in text


async def test_priority_over_http_and_grpc_and_its_errors(folder: Path) -> None:
    levels = {"priority_levels": 2, "default_priority_level": 2}
    config = {
        "grpc": {"host": "127.0.0.1", "port": 0},
        "devices": {"cpu": {"scheduling": "shared", "slots": 1}},
        "models": [_model("a", folder, **levels), _model("b", folder, **levels)],
    }
    gates = _Gates(folder)
    async with in_process(config, folder) as srv, aiohttp.ClientSession() as session:
        http = _Http(session, srv.base)
        device = srv.server.devices.shared["cpu"]
        port = srv.server.grpc.addresses[0][1]  # type: ignore[union-attr]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:

            async def over_grpc(model: str, x: float, priority: int) -> np.ndarray:
                inp = grpcclient.InferInput("X", [1, 1], "FP32")
                inp.set_data_from_numpy(np.array([[x]], np.float32))
                result = await client.infer(model, [inp], priority=priority, client_timeout=60)
                return result.as_numpy("Y")

            first = asyncio.ensure_future(http.post("/v2/models/a/infer", _body(1)))
            await gates.until_ran(1)
            # Low priority (the default level, 2) with the earliest deadline, then
            # level 1 over gRPC on b and over HTTP on a.
            low = asyncio.ensure_future(http.post("/v2/models/a/infer", _body(2), 20_000))
            await _until(lambda: _pending(srv, "a") == 1)
            high_b = asyncio.ensure_future(over_grpc("b", 3, priority=1))
            await _until(lambda: device.waiting == 1)
            high_a = asyncio.ensure_future(http.post("/v2/models/a/infer", _body(4, priority=1)))
            await _until(lambda: _pending(srv, "a") == 2)
            for n in (1, 2, 3, 4):
                gates.open(n)
            done = await asyncio.gather(first, low, high_b, high_a)
            assert [done[0][0], done[1][0], done[3][0]] == [200] * 3
            assert done[2].tolist() == [[3.0]]
            # Level 1 first (b's and a's, both with 60 s: b's came first), then the
            # level-2 request, though its deadline is the earliest.
            assert gates.ran() == ["a 1", "b 3", "a 4", "a 2"]

            status, bad = await http.post("/v2/models/a/infer", _body(5, priority=3))
            assert status == 400 and "not a level of model 'a/1'" in bad["error"]
            status, bad = await http.post("/v2/models/a/infer", _body(5, priority="x"))
            assert status == 400 and "'priority' must be" in bad["error"]
            with pytest.raises(InferenceServerException) as refused:
                await over_grpc("a", 5, priority=7)
            assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
            assert "not a level of model 'a/1'" in refused.value.message()
        finally:
            await client.close()
