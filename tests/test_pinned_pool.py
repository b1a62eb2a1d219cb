"""The instance threads of a ``direct`` sequence model (workers/pinned_pool.py): each
instance runs only the jobs given to it, through its own executor too; a thread that
dies is replaced and its instance's queue served again; stop ends every thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import spec

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.workers.job import BatchJob
from aserve.workers.pinned_pool import PinnedPool

pytestmark = pytest.mark.timeout(30)


class _Where(Engine):
    """Answers each batch with its input and notes the thread that ran it; an input
    of -1 makes the thread die (SystemExit escapes its loop)."""

    def __init__(self, config: ModelConfig, path: Path) -> None:
        super().__init__(config, path)
        self.ran: list[str] = []

    def load(self) -> None:
        pass

    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        if inputs["X"][0, 0] == -1:
            raise SystemExit("dying on purpose")
        self.ran.append(threading.current_thread().name)
        return {"Y": inputs["X"]}


def _engine(tmp_path: Path) -> _Where:
    config = ModelConfig(
        name="m", engine="python", handler="h:H",
        inputs=[spec("X", "FP32", [1])], outputs=[spec("Y", "FP32", [1])],
    )  # fmt: skip
    return _Where(config, tmp_path)


async def _run(submit: Any, value: float) -> BatchJob:
    fut: asyncio.Future[BatchJob] = asyncio.get_running_loop().create_future()
    job = BatchJob([{"X": np.full((1, 1), value, np.float32)}], 1, fut.set_result)
    submit(job)
    return await fut


def test_each_instance_runs_only_its_own_jobs(tmp_path: Path) -> None:
    async def main() -> None:
        engine = _engine(tmp_path)
        pool = PinnedPool(engine, 3, "m")
        await pool.start()
        try:
            for index in (2, 0, 2, 1, 2):
                job = await _run(pool.instance(index).submit, 1.0)
                assert job.error is None and job.outputs is not None
                assert engine.ran[-1] == f"aserve-m-{index}"
            # Unpinned jobs (warm-up's) go to the instances in turn.
            for index in range(3):
                await _run(pool.submit, 1.0)
                assert engine.ran[-1] == f"aserve-m-{index}"
            assert pool.batches == [2, 2, 4]
        finally:
            await pool.stop(5.0)
        assert not any(
            t.is_alive() for t in threading.enumerate() if t.name.startswith("aserve-m-")
        )

    asyncio.run(main())


def test_a_dead_instance_is_replaced_and_serves_its_queue_again(tmp_path: Path) -> None:
    async def main() -> None:
        engine = _engine(tmp_path)
        pool = PinnedPool(engine, 2, "m")
        view = pool.instance(1)
        lives: list[int] = []
        back = asyncio.Event()

        def on_live() -> None:
            lives.append(view.live)
            if view.live == 1:
                back.set()

        view.on_live = on_live
        await pool.start()
        try:
            job = await _run(view.submit, -1.0)
            assert isinstance(job.error, SystemExit)
            await back.wait()
            assert lives == [0, 1] and pool.instance(0).live == 1
            job = await _run(view.submit, 2.0)
            assert job.error is None and engine.ran[-1] == "aserve-m-1"
            assert pool.restarts == 1
        finally:
            await pool.stop(5.0)

    asyncio.run(main())
