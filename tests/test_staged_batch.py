"""The next batch, staged while every instance is busy: grown from the queue until an
instance takes it, taken back when a more urgent request could not join it, and run
by the instance that frees up without waiting for the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import StandInEngine

from aserve.config import BatchingConfig
from aserve.loop.batcher import Batcher
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.workers.job import BatchJob, Staged, Staging
from aserve.workers.thread_pool import ExecutorPool

pytestmark = pytest.mark.timeout(30)

BATCH_S = 1.0  # every batch size "takes" a second


class _StagingPool:
    """A pool as the batcher sees it, with staging: ``instances`` busy until the
    test answers their batches; staged batches are kept for the test to take."""

    def __init__(self, instances: int) -> None:
        self.live = instances
        self.on_live: Any = None
        self.jobs: list[BatchJob] = []
        self.staged: list[Staged] = []

    def submit(self, job: BatchJob) -> None:
        self.jobs.append(job)

    def can_stage(self) -> bool:
        return True

    def stage(self, job: BatchJob) -> Staged:
        staged = Staged(job)
        self.staged.append(staged)
        return staged


def _request(x: float, deadline_in: float = 60.0) -> InferenceRequest:
    now = time.monotonic()
    loop = asyncio.get_running_loop()
    return InferenceRequest({"X": np.array([[x]], np.float32)}, 1, (), now,
                            now + deadline_in, loop.create_future(), None, None)  # fmt: skip


async def _passes() -> None:
    for _ in range(3):  # the batcher pumps with call_soon
        await asyncio.sleep(0)


def _answer(job: Any) -> None:
    """What an instance does with a batch: Y = 2 X, then on_done on the loop."""
    job.outputs = {"Y": 2 * np.concatenate([p["X"] for p in job.parts])}
    job.on_done(job)


def _batcher(pool: Any, max_batch_size: int) -> Batcher:
    batcher = Batcher(
        "m/1",
        BatchingConfig(max_batch_size=max_batch_size, max_delay_ms=0),
        pool,
        ModelStats("m", "1"),
    )
    for size in range(1, max_batch_size + 1):
        batcher.latency.observe(size, BATCH_S)
    return batcher


def test_the_thread_pool_stages() -> None:
    assert isinstance(ExecutorPool(None, 1, "m"), Staging)  # type: ignore[arg-type]


async def test_a_staged_batch_grows_until_taken_then_runs_as_the_next_batch() -> None:
    pool = _StagingPool(1)
    batcher = _batcher(pool, 4)
    try:
        first = _request(1.0)
        batcher.submit(first)
        await _passes()
        assert len(pool.jobs) == 1 and not pool.staged  # an instance was free

        reqs = [_request(float(x)) for x in range(2, 8)]
        batcher.submit(reqs[0])
        batcher.submit(reqs[1])
        await _passes()
        assert len(pool.jobs) == 1 and len(pool.staged) == 1  # all busy: staged
        staged = pool.staged[0]
        # Staged requests still wait: counted pending, not running.
        assert staged.job.size == 2 and batcher.pending == 2 and batcher.running == 1

        batcher.submit(reqs[2])
        await _passes()
        assert staged.job.size == 3 and len(pool.staged) == 1  # grown in place
        for req in reqs[3:]:
            batcher.submit(req)
        await _passes()
        # Full (max_batch_size 4): the sixth waits in the queue.
        assert staged.job.size == 4 and batcher.pending == 6 and len(pool.staged) == 1

        # The instance frees up and takes the staged batch before the loop hears of it.
        assert staged.take() is staged.job
        _answer(pool.jobs[0])
        await _passes()
        assert first.future.result()["Y"].tolist() == [[2.0]]
        # Known to run now; the rest staged behind it.
        assert len(pool.staged) == 2 and pool.staged[1].job.size == 2
        assert batcher.running == 1 and batcher.pending == 2

        _answer(staged.job)
        await _passes()
        assert [r.future.result()["Y"].tolist() for r in reqs[:4]] == [
            [[4.0]], [[6.0]], [[8.0]], [[10.0]]
        ]  # fmt: skip
        last = pool.staged[1]
        assert last.take() is last.job
        _answer(last.job)
        await _passes()
        assert [r.future.result()["Y"].tolist() for r in reqs[4:]] == [[[12.0]], [[14.0]]]
        assert batcher.idle and batcher.running == 0
        assert batcher._stats.execution_count == 3  # three batches, none lost or doubled
    finally:
        batcher.close()


async def test_a_staged_batch_ending_before_a_pump_saw_it_taken_is_answered() -> None:
    pool = _StagingPool(1)
    batcher = _batcher(pool, 4)
    try:
        batcher.submit(_request(1.0))
        await _passes()
        second = _request(2.0)
        batcher.submit(second)
        await _passes()
        staged = pool.staged[0]
        assert staged.take() is staged.job
        _answer(staged.job)  # ends while the loop still counts it staged
        await _passes()
        assert second.future.result()["Y"].tolist() == [[4.0]]
        assert batcher.running == 1  # the first batch, still out
        _answer(pool.jobs[0])
        await _passes()
        assert batcher.idle
    finally:
        batcher.close()


async def test_a_more_urgent_request_takes_the_staged_batch_back() -> None:
    pool = _StagingPool(1)
    batcher = _batcher(pool, 2)
    try:
        batcher.submit(_request(1.0))
        await _passes()
        late = [_request(2.0, 60.0), _request(3.0, 61.0)]
        for req in late:
            batcher.submit(req)
        await _passes()
        staged = pool.staged[0]
        assert staged.job.size == 2  # full

        # Earlier deadline than both: a batch cut now would hold it and the 60 s one.
        urgent = _request(4.0, 10.0)
        batcher.submit(urgent)
        await _passes()
        assert not staged.open and staged.take() is None  # taken back: no instance runs it
        again = pool.staged[1]
        assert [r.future for r in again.job.requests] == [urgent.future, late[0].future]
        assert batcher.pending == 3  # two staged, and the 61 s one in the queue

        assert again.take() is again.job
        _answer(pool.jobs[0])
        await _passes()
        _answer(again.job)
        await _passes()
        assert urgent.future.result()["Y"].tolist() == [[8.0]]
        assert late[0].future.result()["Y"].tolist() == [[4.0]]
        third = pool.staged[2]
        assert third.take() is third.job
        _answer(third.job)
        await _passes()
        assert late[1].future.result()["Y"].tolist() == [[6.0]]
    finally:
        batcher.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _at(clock: _Clock, x: float, deadline_in: float) -> InferenceRequest:
    loop = asyncio.get_running_loop()
    return InferenceRequest({"X": np.array([[x]], np.float32)}, 1, (), clock.now,
                            clock.now + deadline_in, loop.create_future(), None, None)  # fmt: skip


async def test_a_staged_batch_that_starts_early_is_expected_to_end_from_its_start() -> None:
    """A staged batch's end is first predicted from the running batch's expected end.
    Once an instance takes it, it is expected to end one estimate after it started:
    kept on the prediction it was staged on, the expected ends drifted ahead of the
    model with every batch that ended early, the next batch was staged for a start
    later than its requests' deadlines allow and cut to one request (a retry storm's
    thread row ran every batch alone: bench/RESULTS-overload.md)."""
    clock = _Clock()
    pool = _StagingPool(1)
    batcher = Batcher("m/1", BatchingConfig(max_batch_size=4, max_delay_ms=0), pool,
                      ModelStats("m", "1"), clock=clock)  # fmt: skip
    for size in range(1, 5):
        batcher.latency.observe(size, BATCH_S)
    try:
        first = _at(clock, 1.0, 60.0)
        batcher.submit(first)  # runs, expected to end in 1 s
        await _passes()
        second = _at(clock, 2.0, 60.0)
        batcher.submit(second)  # staged behind it, predicted to end in 2 s
        await _passes()
        staged = pool.staged[0]
        clock.now += 0.1  # the first batch ended early: the instance takes the staged one
        assert staged.take() is staged.job
        _answer(pool.jobs[0])
        await _passes()
        # Two requests that a batch starting when the second ends (1 s after it
        # started) serves in time, but not one starting 2 s from the first's start.
        pair = [_at(clock, 3.0, 2.4), _at(clock, 4.0, 2.4)]
        for req in pair:
            batcher.submit(req)
        await _passes()
        assert len(pool.staged) == 2
        assert pool.staged[1].job.size == 2  # staged together, not cut to one

        _answer(staged.job)
        await _passes()
        last = pool.staged[1]
        assert last.take() is last.job
        _answer(last.job)
        await _passes()
        assert [r.future.result()["Y"].tolist() for r in (first, second, *pair)] == [
            [[2.0]], [[4.0]], [[6.0]], [[8.0]]
        ]  # fmt: skip
    finally:
        batcher.close()


class _GatedEngine(StandInEngine):
    """Y = 2 X; a batch holding X == 1 waits for ``release``, and ``second`` is set
    when a batch holding X == 2 starts."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.first = threading.Event()
        self.second = threading.Event()

    def run(self, inputs: dict[str, np.ndarray], instance: int) -> dict[str, np.ndarray]:
        x = inputs["X"]
        if np.any(x == 1.0):
            self.first.set()
            self.release.wait(20)
        if np.any(x == 2.0):
            self.second.set()
        return {"Y": 2 * x}


async def test_the_instance_runs_the_staged_batch_without_the_loop() -> None:
    engine = _GatedEngine()
    pool = ExecutorPool(engine, 1, "gated")  # type: ignore[arg-type]
    await pool.start()
    batcher = Batcher("gated/1", BatchingConfig(max_batch_size=4, max_delay_ms=0), pool,
                      ModelStats("gated", "1"))  # fmt: skip
    try:
        first = _request(1.0)
        batcher.submit(first)
        assert await asyncio.to_thread(engine.first.wait, 20)  # running, held
        second = _request(2.0)
        batcher.submit(second)
        await _passes()
        assert batcher.running == 1 and batcher.pending == 1  # staged behind the first
        # The loop is held here, in this callback, until the second batch starts:
        # only an instance that takes the next batch by itself can start it.
        engine.release.set()
        started = engine.second.wait(20)
        assert started, "the second batch waited for the event loop"
        results = await asyncio.wait_for(asyncio.gather(first.future, second.future), 20)
        assert [r["Y"].tolist() for r in results] == [[[2.0]], [[4.0]]]
    finally:
        engine.release.set()
        batcher.close()
        await pool.stop()
