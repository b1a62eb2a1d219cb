"""``cpu_threads`` for python handlers: torch's intra-op threads on every thread
that runs the handler (its handler threads and executor threads, and each
worker process), and torch left unimported for a handler that does not use it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from conftest import ServerProcess, spec, start_server, write_config
from reload_helpers import copy_handler

pytestmark = pytest.mark.timeout(120)

# Neither torch's default on a small machine (its cores) nor the config's default (1).
THREADS = 7


def threads_model(name: str, executor: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "torch_threads:TorchThreads",
        "executor": executor, "cpu_threads": THREADS, "instances": 2,
        "inputs": [spec("X", "FP32", [1])],
        "outputs": [spec(n, "INT64", [1]) for n in ("PRE", "INFER", "POST")],
        # A long deadline: these answers must not depend on how busy the machine is.
        "batching": {"max_batch_size": 4, "max_delay_ms": 1, "timeout_ms": 60_000}, **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("cpu-threads")
    copy_handler(folder, "torch_threads")
    models = [
        threads_model("in_threads", "thread"),
        threads_model("in_processes", "process"),
        threads_model("torch_free", "process", parameters={"torch": False}),
    ]
    server = start_server(write_config(folder, {"models": models}))
    yield server
    server.stop()


async def _ask(base: str, model: str, n: int = 8) -> list[dict[str, list[int]]]:
    body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    url = f"{base}/v2/models/{model}/infer"
    async with aiohttp.ClientSession() as session:
        answers = []
        for _ in range(n):  # several: each of the handler threads and instances may serve one
            async with session.post(url, json=body) as r:
                doc = await r.json()
                assert r.status == 200, doc
            answers.append({o["name"]: o["data"] for o in doc["outputs"]})
    return answers


@pytest.mark.parametrize("model", ["in_threads", "in_processes"])
async def test_cpu_threads_sets_torchs_threads_wherever_the_handler_runs(
    srv: ServerProcess, model: str
) -> None:
    for out in await _ask(srv.base, model):
        assert out == {"PRE": [THREADS], "INFER": [THREADS], "POST": [THREADS]}, out


async def test_a_handler_without_torch_gets_no_torch_in_its_worker(srv: ServerProcess) -> None:
    for out in await _ask(srv.base, "torch_free", 2):
        assert out == {"PRE": [-1], "INFER": [0], "POST": [-1]}, out
