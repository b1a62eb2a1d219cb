"""Tiny batches run on the loop's thread once measured tiny; slow ones never do."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
from helpers import StandInEngine

from aserve.workers.job import BatchJob
from aserve.workers.thread_pool import ExecutorPool


class _Engine(StandInEngine):
    """Doubles X; ``delay_s`` makes it slow. Records the thread each run was on."""

    inline_capable = True

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.threads: list[int] = []

    def run(self, inputs: dict[str, np.ndarray], instance: int) -> dict[str, np.ndarray]:
        self.threads.append(threading.get_ident())
        if self.delay_s:
            time.sleep(self.delay_s)
        if np.any(inputs["X"] < 0):
            raise ValueError("negative")
        return {"Y": inputs["X"] * 2}


async def run_batch(pool: ExecutorPool, *xs: float) -> BatchJob:
    fut: asyncio.Future[BatchJob] = asyncio.get_running_loop().create_future()
    pool.submit(BatchJob([{"X": np.array([x])} for x in xs], len(xs), fut.set_result))
    return await asyncio.wait_for(fut, 10)


async def test_a_tiny_model_moves_onto_the_loop_after_its_first_runs() -> None:
    engine = _Engine()
    pool = ExecutorPool(engine, 1, "tiny")  # type: ignore[arg-type]
    await pool.start()
    loop_thread = threading.get_ident()
    try:
        for i in range(8):  # measured on the thread first
            job = await run_batch(pool, float(i))
            assert job.outputs is not None and job.outputs["Y"][0] == 2 * i
        assert pool.inline_batches == 0 and loop_thread not in engine.threads
        # Inline now, or (on a busy machine, where the thread's runs measured over
        # the budget) after a probe on the loop: one batch in 64.
        for i in range(4 * 64):
            if pool.runs_inline(1):
                break
            await run_batch(pool, float(i))
        assert pool.runs_inline(1)
        probes = pool.inline_batches
        job = await run_batch(pool, 21.0)
        assert job.outputs is not None and job.outputs["Y"][0] == 42.0
        assert pool.inline_batches == probes + 1 and engine.threads[-1] == loop_thread
        # Another batch size class is measured on its own before it moves.
        job = await run_batch(pool, 1.0, 2.0, 3.0)
        assert pool.inline_batches == probes + 1 and engine.threads[-1] != loop_thread
        # An error inline fails its batch only, like on a thread.
        failed = await run_batch(pool, -1.0)
        assert isinstance(failed.error, ValueError) and failed.outputs is None
        assert pool.inline_batches == probes + 2 and pool.live == 1
    finally:
        await pool.stop()


async def test_a_slow_model_never_runs_on_the_loop() -> None:
    engine = _Engine(delay_s=0.002)  # 2 ms: far over the inline budget
    pool = ExecutorPool(engine, 1, "slow")  # type: ignore[arg-type]
    await pool.start()
    try:
        for _ in range(12):
            assert (await run_batch(pool, 1.0)).error is None
        assert pool.inline_batches == 0
        assert threading.get_ident() not in engine.threads
    finally:
        await pool.stop()


class _SlowOffTheLoop(_Engine):
    """Instant on the loop's thread, 0.3 ms on any other: what a tiny model's runs on
    a thread look like at load, waiting for the GIL between its calls."""

    def __init__(self, loop_thread: int) -> None:
        super().__init__()
        self.loop_thread = loop_thread

    def run(self, inputs: dict[str, np.ndarray], instance: int) -> dict[str, np.ndarray]:
        if threading.get_ident() != self.loop_thread:
            time.sleep(0.0003)
        return super().run(inputs, instance)


async def test_a_model_slow_only_on_its_threads_is_probed_on_the_loop_and_moves_there() -> None:
    loop_thread = threading.get_ident()
    engine = _SlowOffTheLoop(loop_thread)
    pool = ExecutorPool(engine, 1, "probed")  # type: ignore[arg-type]
    await pool.start()
    try:
        for i in range(8):  # measured on the thread: 0.3 ms, over the inline budget
            assert (await run_batch(pool, float(i))).error is None
        assert not pool.runs_inline(1) and pool.inline_batches == 0
        # One batch in 64 of the class runs on the loop, where it is measured tiny
        # (a probe the machine preempted may measure slow: the next one decides).
        i = 0
        while not pool.runs_inline(1) and i < 4 * 64:
            job = await run_batch(pool, float(i))
            assert job.outputs is not None and job.outputs["Y"][0] == 2 * i
            i += 1
        assert pool.runs_inline(1) and i % 64 == 0
        on_loop = [n for n, t in enumerate(engine.threads) if t == loop_thread]
        assert on_loop == [8 + 64 * k - 1 for k in range(1, i // 64 + 1)]
        # From then on it runs on the loop.
        probes = pool.inline_batches
        await run_batch(pool, 1.0)
        assert pool.inline_batches == probes + 1 and engine.threads[-1] == loop_thread
    finally:
        await pool.stop()


async def test_a_model_slow_on_the_loop_too_stays_on_its_threads() -> None:
    engine = _Engine(delay_s=0.0003)  # 0.3 ms everywhere: over the budget, under the probe bound
    pool = ExecutorPool(engine, 1, "slow-everywhere")  # type: ignore[arg-type]
    await pool.start()
    loop_thread = threading.get_ident()
    try:
        for i in range(8 + 3 * 64):  # three probes, each measured slow on the loop
            assert (await run_batch(pool, float(i))).error is None
        assert pool.inline_batches == 3 and not pool.runs_inline(1)
        assert engine.threads.count(loop_thread) == 3
    finally:
        await pool.stop()
