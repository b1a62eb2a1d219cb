"""What happens to a staged batch besides growing: a member's client leaves, the
model unloads, a deadline passes, and cancelled requests in the queue it is cut
from. Each case twice where it matters: before an instance took the batch (the
loop may still change it) and after (it runs, and ends as any running batch)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from test_staged_batch import _answer, _passes, _StagingPool  # the same pump, instance and pool

from aserve.config import BatchingConfig
from aserve.errors import DeadlineExceeded, Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.workers.job import BatchJob, Staged

pytestmark = pytest.mark.timeout(30)

BATCH_S = 1.0  # every batch size "takes" a second


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Pool:
    """One instance, busy until the test answers its batch; no staging."""

    def __init__(self) -> None:
        self.live = 1
        self.on_live: Any = None
        self.jobs: list[BatchJob] = []

    def submit(self, job: BatchJob) -> None:
        self.jobs.append(job)


def _batcher(pool: Any, clock: _Clock) -> Batcher:
    batcher = Batcher("m/1", BatchingConfig(max_batch_size=4, max_delay_ms=0), pool,
                      ModelStats("m", "1"), clock=clock)  # fmt: skip
    for size in range(1, 5):
        batcher.latency.observe(size, BATCH_S)
    return batcher


def _request(clock: _Clock, x: float, deadline_in: float = 60.0) -> InferenceRequest:
    loop = asyncio.get_running_loop()
    return InferenceRequest({"X": np.array([[x]], np.float32)}, 1, (), clock.now,
                            clock.now + deadline_in, loop.create_future(), None, None)  # fmt: skip


async def _staged_behind_one(
    batcher: Batcher, pool: _StagingPool, clock: _Clock, *deadlines_in: float
) -> tuple[InferenceRequest, list[InferenceRequest], Staged]:
    """One request running, and one staged batch of a request per deadline."""
    first = _request(clock, 1.0)
    batcher.submit(first)
    await _passes()
    waiting = [_request(clock, 2.0 + i, d) for i, d in enumerate(deadlines_in)]
    for req in waiting:
        batcher.submit(req)
    await _passes()
    assert len(pool.staged) == 1 and pool.staged[0].job.size == len(waiting)
    return first, waiting, pool.staged[0]


def _leave(batcher: Batcher, req: InferenceRequest) -> None:
    """The client went away: what the runtimes do."""
    req.future.cancel()
    batcher.forget(req)


async def test_a_member_leaving_a_staged_batch_is_taken_out_and_the_last_takes_it_back() -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    try:
        first, (a, b), staged = await _staged_behind_one(batcher, pool, clock, 60.0, 61.0)
        _leave(batcher, a)
        assert staged.open and staged.job.size == 1 and list(staged.job.parts) == [b.inputs]
        assert batcher.pending == 1 and batcher._stats.cancelled == 1
        _leave(batcher, b)
        assert not staged.open and staged.take() is None  # nothing left: taken back
        assert batcher.pending == 0 and batcher._stats.cancelled == 2
        _answer(pool.jobs[0])
        await _passes()
        assert first.future.result()["Y"].tolist() == [[2.0]]
        assert batcher.idle and len(pool.staged) == 1  # nothing staged again
    finally:
        batcher.close()


async def test_a_member_leaving_a_taken_batch_ends_with_it() -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    try:
        _, (a, b), staged = await _staged_behind_one(batcher, pool, clock, 60.0, 61.0)
        assert staged.take() is staged.job
        _leave(batcher, a)
        assert staged.job.size == 2 and batcher._stats.cancelled == 0  # running: unchanged
        _answer(pool.jobs[0])
        await _passes()
        _answer(staged.job)
        await _passes()
        assert a.future.cancelled() and b.future.result()["Y"].tolist() == [[6.0]]
        assert batcher.idle
    finally:
        batcher.close()


async def test_close_answers_a_staged_batch_no_instance_took() -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    first, (a,), staged = await _staged_behind_one(batcher, pool, clock, 60.0)
    timer = staged.job.timer  # type: ignore[attr-defined]
    batcher.close()
    assert not staged.open and staged.take() is None
    assert isinstance(a.future.exception(), Unavailable)
    assert timer.cancelled() and batcher.pending == 0
    assert not first.future.done()  # running: it ends with its batch
    _answer(pool.jobs[0])
    await _passes()
    assert first.future.result()["Y"].tolist() == [[2.0]]


async def test_close_leaves_a_taken_batch_to_its_instance() -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    first, (a,), staged = await _staged_behind_one(batcher, pool, clock, 60.0)
    assert staged.take() is staged.job
    batcher.close()
    assert not a.future.done()
    _answer(staged.job)
    _answer(pool.jobs[0])
    await _passes()
    assert a.future.result()["Y"].tolist() == [[4.0]]
    assert first.future.result()["Y"].tolist() == [[2.0]]
    assert batcher.idle


@pytest.mark.parametrize("taken", [False, True])
async def test_a_staged_batch_past_its_deadline_is_answered_by_its_guard(taken: bool) -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    try:
        _, (a, b), staged = await _staged_behind_one(batcher, pool, clock, 5.0, 50.0)
        if taken:  # and the loop knows it: the first batch's end pumps
            assert staged.take() is staged.job
            _answer(pool.jobs[0])
            await _passes()
            assert batcher.running == 1 and batcher.pending == 0
        clock.now += 10.0
        batcher._expire_running(staged.job)  # type: ignore[arg-type]  # what its timer calls
        error = a.future.exception()
        assert isinstance(error, DeadlineExceeded)
        where = "was still running its batch" if taken else "waiting in the queue"
        assert where in str(error)
        assert not b.future.done()  # 40 s left: its guard is armed again
        assert staged.job.timer is not None  # type: ignore[attr-defined]
    finally:
        batcher.close()


async def test_a_member_with_an_earlier_deadline_rearms_the_staged_batch_guard() -> None:
    clock, pool = _Clock(), _StagingPool(1)
    batcher = _batcher(pool, clock)
    try:
        _, _, staged = await _staged_behind_one(batcher, pool, clock, 60.0)
        timer = staged.job.timer  # type: ignore[attr-defined]
        urgent = _request(clock, 9.0, 30.0)
        batcher.submit(urgent)
        await _passes()
        assert staged.open and urgent in staged.job.requests  # type: ignore[attr-defined]
        assert timer.cancelled() and staged.job.timer is not timer  # type: ignore[attr-defined]
        assert staged.job.earliest == urgent.deadline  # type: ignore[attr-defined]
    finally:
        batcher.close()


async def test_cancelled_requests_at_the_head_of_the_queue_are_skipped() -> None:
    clock, pool = _Clock(), _Pool()
    batcher = _batcher(pool, clock)
    try:
        first = _request(clock, 1.0)
        batcher.submit(first)
        await _passes()
        gone = [_request(clock, 2.0, 10.0), _request(clock, 3.0, 11.0)]
        kept = _request(clock, 4.0, 20.0)
        for req in (*gone, kept):
            batcher.submit(req)
        await _passes()
        assert batcher.pending == 3 and len(pool.jobs) == 1  # queued behind the first
        for req in gone:
            _leave(batcher, req)
        assert batcher.pending == 1
        _answer(pool.jobs[0])
        await _passes()
        assert len(pool.jobs) == 2 and pool.jobs[1].size == 1  # the cancelled ones left out
        _answer(pool.jobs[1])
        await _passes()
        assert kept.future.result()["Y"].tolist() == [[8.0]]
        assert batcher.idle
    finally:
        batcher.close()
