"""Executor threads that die are restarted; the batch in flight fails, nothing hangs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from conftest import ServerProcess, spec, start_server, write_config
from helpers import StandInEngine
from reload_helpers import copy_handler, wait_log

from aserve.codecs.validate import check_batch
from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.errors import InternalError
from aserve.loop.runtimes.batched import ModelRuntime
from aserve.workers.job import BatchJob
from aserve.workers.thread_pool import ExecutorPool

pytestmark = pytest.mark.timeout(60)

MAGIC = -999.0


@pytest.fixture(scope="module")
def killer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("faults")
    copy_handler(folder, "thread_killer")
    model = {
        "name": "killer", "engine": "python", "handler": "thread_killer:Killer",
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [2])],
        "batching": {"max_batch_size": 1, "max_delay_ms": 0},
    }  # fmt: skip
    srv = start_server(write_config(folder, {"models": [model]}))
    yield srv
    srv.stop()


def body(a: float, b: float = 1.0) -> dict[str, Any]:
    return {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [a, b]}]}


async def infer(session: aiohttp.ClientSession, base: str, a: float) -> tuple[int, Any]:
    async with session.post(f"{base}/v2/models/killer/infer", json=body(a)) as r:
        return r.status, await r.json()


async def wait_ready(session: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        async with session.get(f"{base}/v2/models/killer/ready") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the model never became ready again")


async def test_a_dead_executor_thread_is_restarted(killer: ServerProcess) -> None:
    base = killer.base
    async with aiohttp.ClientSession() as session:
        assert await infer(session, base, 1.0) == (200, _expected(1.0))
        for _ in range(2):  # and again: the replacement is supervised too
            status, doc = await infer(session, base, MAGIC)
            assert status == 500
            assert doc["error"] == "model 'killer/1' failed: killed on purpose"
            await wait_ready(session, base)
            assert await infer(session, base, 2.0) == (200, _expected(2.0))
            wait_log(
                killer,
                "executor thread 0 of 'killer' died (SystemExit('killed on purpose')); restarting it",
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the log arrives through a pipe
            if killer.log_text().count("executor thread 0 of 'killer' is back") == 2:
                break
            await asyncio.sleep(0.02)
        assert killer.log_text().count("executor thread 0 of 'killer' is back") == 2

        # A request sent beside the fatal one is answered either way: served (queued
        # before the thread died, by the replacement) or refused while it restarts.
        # test_pool_counts_a_dead_thread_out_until_it_is_back pins the queued case.
        (s1, _), (s2, doc2) = await asyncio.gather(
            infer(session, base, MAGIC), infer(session, base, 3.0)
        )
        assert s1 == 500
        assert (s2, doc2) == (200, _expected(3.0)) or (s2, doc2) == (503, {
            "error": "model 'killer/1' is not ready: its executor thread died and is restarting"
        })  # fmt: skip
        await wait_ready(session, base)
        async with session.get(f"{base}/v2/health/ready") as r:
            assert r.status == 200
    assert killer.proc.poll() is None  # the server lives on


def _expected(a: float) -> dict[str, Any]:
    return {"model_name": "killer", "model_version": "1",
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1, 2], "data": [2 * a, 2.0]}]}  # fmt: skip


class _Engine(StandInEngine):
    """A stand-in engine: doubles X; dies with SystemExit on -999; its second
    and later instances wait for ``gate`` before they exist."""

    inline_capable = False  # every batch on the instance thread, which can die

    def __init__(self) -> None:
        self.created = 0
        self.gate = threading.Event()

    def create_instance(self, index: int) -> int:
        self.created += 1
        if self.created > 1:
            self.gate.wait(10)
        return index

    def run(self, inputs: dict[str, np.ndarray], instance: int) -> dict[str, np.ndarray]:
        if np.any(inputs["X"] == MAGIC):
            raise SystemExit("boom")
        if np.any(inputs["X"] < 0):
            raise ValueError("negative")
        return {"Y": inputs["X"] * 2}


async def _run(pool: ExecutorPool, x: float) -> BatchJob:
    fut: asyncio.Future[BatchJob] = asyncio.get_running_loop().create_future()
    pool.submit(BatchJob([{"X": np.array([x])}], 1, fut.set_result))
    return await asyncio.wait_for(fut, 10)


async def test_pool_counts_a_dead_thread_out_until_it_is_back() -> None:
    engine = _Engine()
    pool = ExecutorPool(engine, 1, "stand-in")  # type: ignore[arg-type]
    lives: list[int] = []
    went_down = asyncio.Event()

    def heard() -> None:
        lives.append(pool.live)
        if pool.live == 0:
            went_down.set()

    pool.on_live = heard
    await pool.start()
    try:
        assert pool.live == 1
        failed = await _run(pool, -1.0)  # an Exception fails the batch; the thread lives
        assert isinstance(failed.error, ValueError) and pool.live == 1 and pool.restarts == 0
        killed = await _run(pool, MAGIC)
        assert isinstance(killed.error, SystemExit) and killed.outputs is None
        await asyncio.wait_for(went_down.wait(), 30)
        assert pool.live == 0 and lives == [0] and pool.restarts == 1
        queued = asyncio.ensure_future(_run(pool, 4.0))  # waits for the replacement
        await asyncio.sleep(0.05)
        assert not queued.done()
        engine.gate.set()
        job = await queued
        assert job.error is None and job.outputs is not None and job.outputs["Y"][0] == 8.0
        assert pool.live == 1 and lives == [0, 1]
    finally:
        engine.gate.set()
        await pool.stop()


class _HeldEngine(_Engine):
    """``_Engine`` as a model's engine: ``instances`` come up at once, and a
    replacement for one that died waits for ``gate``, so a test sees the model
    while the restart is under way."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def load(self) -> None:
        pass

    def unload(self) -> None:
        pass

    def create_instance(self, index: int) -> int:
        self.created += 1
        if self.created > self.config.instances:
            self.gate.wait(10)
        return index


class _StandInRuntime(ModelRuntime):
    """A model runtime whose engine is the given one (no file to load)."""

    def __init__(self, config: ModelConfig, base_dir: Path, engine: _HeldEngine) -> None:
        super().__init__(config, base_dir)
        self._engine = engine

    def model_path(self) -> Path | None:
        return None

    def _create_engine(self, path: Path | None) -> Engine:
        return self._engine  # type: ignore[return-value]


async def _infer(runtime: ModelRuntime, x: float) -> np.ndarray:
    inputs = {"X": np.array([[x, 1.0]], np.float32)}
    size, key = check_batch(inputs, runtime.input_specs, runtime.name, 4, False)
    outputs = await asyncio.wait_for(runtime.infer(inputs, size, key, 10.0), 20)
    return outputs["Y"]


async def test_with_two_instances_a_dead_thread_leaves_the_model_ready(tmp_path: Path) -> None:
    config = ModelConfig(
        name="pair", engine="torch", path="unused.pt", instances=2,
        inputs=[spec("X", "FP32", [2])], outputs=[spec("Y", "FP32", [2])],
        batching={"max_batch_size": 4, "max_delay_ms": 0},
    )  # fmt: skip
    engine = _HeldEngine(config)
    runtime = _StandInRuntime(config, tmp_path, engine)
    await runtime.load()
    try:
        assert runtime.ready and engine.created == 2
        with pytest.raises(InternalError, match="boom"):
            await _infer(runtime, MAGIC)  # its thread dies
        for _ in range(1000):  # until the replacement thread is being created (and held)
            if engine.created == 3:
                break
            await asyncio.sleep(0.01)
        assert engine.created == 3
        # The other instance serves meanwhile: ready, and every request answered.
        assert runtime.ready and runtime.not_ready_reason() is None
        answers = await asyncio.gather(*(_infer(runtime, float(i)) for i in range(12)))
        assert [a.tolist() for a in answers] == [[[2.0 * i, 2.0]] for i in range(12)]
        assert runtime.ready
        engine.gate.set()
        assert (await _infer(runtime, 5.0)).tolist() == [[10.0, 2.0]]
    finally:
        engine.gate.set()
        await runtime.unload()
