"""The idle fast path: a request that finds a tiny inline model idle is answered
inside ``submit``, with no turn of the loop; requests that come together still
batch together."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from helpers import StandInEngine

from aserve.config import BatchingConfig
from aserve.loop.batcher import Batcher
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.workers.thread_pool import ExecutorPool

pytestmark = pytest.mark.timeout(30)


class _Doubler(StandInEngine):
    """Y = 2 X, recording each batch's size and the thread it ran on."""

    inline_capable = True

    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []  # (batch size, thread)

    def run(self, inputs: dict[str, np.ndarray], instance: int) -> dict[str, np.ndarray]:
        self.runs.append((len(inputs["X"]), threading.get_ident()))
        if np.any(inputs["X"] < 0):
            raise ValueError("negative input")
        return {"Y": inputs["X"] * 2}


def _request(x: float) -> InferenceRequest:
    now = time.monotonic()
    return InferenceRequest({"X": np.array([[x]], np.float32)}, 1, (), now, now + 60.0,
                            asyncio.get_running_loop().create_future(), None, None)  # fmt: skip


async def _settled(futures: list[asyncio.Future]) -> None:
    await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)


async def _inline_batcher() -> tuple[Batcher, ExecutorPool, _Doubler, ModelStats]:
    """A batcher over one instance whose batches of 1 and of 2-3 run inline
    (each size class measured tiny on the thread first, as in production)."""
    engine = _Doubler()
    pool = ExecutorPool(engine, 1, "tiny")  # type: ignore[arg-type]
    await pool.start()
    stats = ModelStats("tiny", "1")
    batching = BatchingConfig(max_batch_size=8, max_delay_ms=0, preferred_batch_sizes=[])
    batcher = Batcher("tiny/1", batching, pool, stats)
    # Size classes 2-3 and 1, each on the thread until measured tiny (8 runs; on a
    # busy machine, where those measured over the budget, until a probe on the loop
    # did: one batch in 64).
    for group in ([1.0, 2.0], [1.0]):
        for _ in range(8 + 4 * 64):
            if pool.runs_inline(len(group)):
                break
            reqs = [_request(x) for x in group]
            for r in reqs:
                batcher.submit(r)
            await _settled([r.future for r in reqs])
    assert pool.runs_inline(1) and pool.runs_inline(2)
    engine.runs.clear()
    return batcher, pool, engine, stats


async def test_an_idle_tiny_model_answers_inside_submit() -> None:
    batcher, pool, engine, stats = await _inline_batcher()
    loop_thread = threading.get_ident()
    try:
        await asyncio.sleep(0)  # the pumps of the warm-up have run
        inline_before = pool.inline_batches
        executed, served = stats.execution_count, stats.success.count
        req = _request(21.0)
        batcher.submit(req)
        # Answered before submit returned: no turn of the loop in between.
        assert req.future.done()
        assert float(req.future.result()["Y"][0, 0]) == 42.0
        assert engine.runs == [(1, loop_thread)]
        assert pool.inline_batches == inline_before + 1
        assert batcher.idle
        # Kept in the records as any batch: one batch run, one success counted.
        assert (stats.execution_count, stats.success.count) == (executed + 1, served + 1)
        # A failure answers its own request only, and inside submit too.
        bad = _request(-1.0)
        await asyncio.sleep(0)
        batcher.submit(bad)
        assert bad.future.done() and isinstance(bad.future.exception(), Exception)
        assert "negative input" in str(bad.future.exception())
    finally:
        await pool.stop()


async def test_requests_that_come_in_one_pass_still_batch_together() -> None:
    batcher, pool, engine, _ = await _inline_batcher()
    try:
        await asyncio.sleep(0)
        first, second, third = _request(1.0), _request(2.0), _request(3.0)
        for r in (first, second, third):  # parsed in one pass of the loop
            batcher.submit(r)
        # The first found the model idle and ran at once; the others queued for
        # the pump that follows it, which runs them as one batch.
        assert first.future.done() and not second.future.done() and not third.future.done()
        await _settled([second.future, third.future])
        assert [size for size, _ in engine.runs] == [1, 2]
        # That pump saw requests come together: the next one queues too (batched
        # with whatever comes in its pass), until a pump sees one come alone.
        fourth = _request(4.0)
        batcher.submit(fourth)
        assert not fourth.future.done()
        await _settled([fourth.future])
        fifth = _request(5.0)
        batcher.submit(fifth)
        assert fifth.future.done()
        assert float(fifth.future.result()["Y"][0, 0]) == 10.0
    finally:
        await pool.stop()


async def test_no_fast_path_for_a_size_not_measured_tiny_or_a_busy_model() -> None:
    batcher, pool, engine, _ = await _inline_batcher()
    try:
        await asyncio.sleep(0)
        # Batches of 4-7 were never measured: they go to the thread, answered later.
        big = InferenceRequest({"X": np.arange(4, dtype=np.float32).reshape(4, 1)}, 4, (),
                               time.monotonic(), time.monotonic() + 60.0,
                               asyncio.get_running_loop().create_future(), None, None)  # fmt: skip
        batcher.submit(big)
        assert not big.future.done()
        # While it is out, a request of size 1 finds the model busy and queues.
        small = _request(1.0)
        batcher.submit(small)
        assert not small.future.done()
        await _settled([big.future, small.future])
        assert big.future.result()["Y"][:, 0].tolist() == [0.0, 2.0, 4.0, 6.0]
        assert float(small.future.result()["Y"][0, 0]) == 2.0
        assert engine.runs[0][1] != threading.get_ident()  # the batch of 4 ran on the thread
    finally:
        await pool.stop()
