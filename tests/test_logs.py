"""Structured logs: JSON lines, the access log, and x-request-id in and out."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from gen_helpers import GENERATION

pytestmark = pytest.mark.timeout(90)

AFFINE = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
BAD = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def logged(
    model_dir: Path, decoder_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    models = [
        model_entry(
            "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
            [spec("OUTPUT0", "FP32", [16])],
        ),
        {**gpt2, "generation": GENERATION},
    ]  # fmt: skip
    config = {
        "grpc": {"port": 0},
        "logging": {"format": "json", "access_log": True},
        "models": models,
    }
    srv = start_server(write_config(tmp_path_factory.mktemp("logs"), config))
    yield srv
    srv.stop()


def access_lines(srv: ServerProcess) -> list[dict[str, Any]]:
    return [d for d in map(json.loads, srv.log) if d["logger"] == "aserve.access"]


def wait_for_access(srv: ServerProcess, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [d for d in access_lines(srv) if d.get("request_id") == request_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


async def test_request_ids_go_in_and_out_and_every_request_is_logged(
    logged: ServerProcess,
) -> None:
    base = logged.base
    url = base + "/v2/models/affine/infer"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=AFFINE, headers={"X-Request-Id": "abc-123"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "abc-123"
        async with session.post(url, json=AFFINE) as r:
            made = r.headers["X-Request-Id"]
            assert len(made) == 16 and int(made, 16) >= 0  # one made for it
        async with session.post(url, json=AFFINE, headers={"X-Request-Id": "x" * 200}) as r:
            assert r.headers["X-Request-Id"] != "x" * 200  # too long: replaced
        async with session.post(url, json=BAD, headers={"X-Request-Id": "bad-1"}) as r:
            assert r.status == 400
            assert r.headers["X-Request-Id"] == "bad-1"
        body = {"model": "gpt2", "prompt": "Hello", "max_tokens": 5, "stream": True}
        async with session.post(
            base + "/v1/completions", json=body, headers={"X-Request-Id": "stream-9"}
        ) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "stream-9"  # sent before the first event
            await r.read()
    client = grpcclient.InferenceServerClient(logged.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.full((1, 16), 0.5, np.float32))
    await asyncio.to_thread(client.infer, "affine", [inp], headers={"x-request-id": "grpc-7"})
    client.close()

    ok = wait_for_access(logged, "abc-123")
    assert (ok["protocol"], ok["model"], ok["version"], ok["status"]) == (
        "http", "affine", "1", "ok",
    )  # fmt: skip
    assert ok["duration_ms"] > 0 and ok["queue_ms"] >= 0 and ok["compute_ms"] > 0
    assert ok["duration_ms"] >= ok["queue_ms"] + ok["compute_ms"] * 0.99
    assert wait_for_access(logged, made)["status"] == "ok"
    bad = wait_for_access(logged, "bad-1")
    assert (bad["status"], bad["model"]) == ("invalid_argument", "affine")
    stream = wait_for_access(logged, "stream-9")
    assert (stream["protocol"], stream["model"], stream["status"]) == ("openai", "gpt2", "ok")
    assert stream["queue_ms"] >= 0
    grpc_line = wait_for_access(logged, "grpc-7")
    assert (grpc_line["protocol"], grpc_line["status"]) == ("grpc", "ok")


def test_every_line_is_one_json_object(logged: ServerProcess) -> None:
    docs = [json.loads(line) for line in logged.log]  # raises on any line that is not
    assert all({"time", "level", "logger"} <= d.keys() for d in docs)
    assert any("listening on http://" in d.get("message", "") for d in docs)
