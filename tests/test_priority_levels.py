"""Triton's priority levels in one model's batcher, on a fake clock: per-level queue
limits, timeouts and DELAY, and low levels timed out at their own deadlines."""

from __future__ import annotations

import pytest
from test_device_scheduler import BATCH_S, _Clock, _Model, _passes

from aserve.errors import DeadlineExceeded, InvalidArgument, QueueFull

pytestmark = pytest.mark.timeout(30)


async def test_a_full_level_refuses_only_its_own_requests() -> None:
    clock, log = _Clock(), []
    m = _Model("m", clock, log, priority_levels=2, default_priority_level=2,
               priority_queue_policy={2: {"max_queue_size": 2}})  # fmt: skip
    try:
        m.send(100.0)  # runs: the instance is busy from here
        await _passes()
        m.send(100.0)
        m.send(100.0)
        with pytest.raises(QueueFull, match="priority level 2 is full"):
            m.send(100.0)
        m.send(100.0, priority=1)  # level 1 has no limit of its own
        with pytest.raises(InvalidArgument, match="not a level"):
            m.send(100.0, priority=3)
    finally:
        m.batcher.close()


async def test_admission_of_a_high_level_ignores_the_low_queue() -> None:
    clock, log = _Clock(), []
    m = _Model("m", clock, log, priority_levels=2, default_priority_level=2)
    try:
        m.send(100.0)
        await _passes()
        for _ in range(12):  # three batches of 4 at level 2
            m.send(100.0)
        now = clock.now
        # Level 1 runs after the running batch: 2 s. Level 2 waits for the 12: 5 s.
        m.batcher.check_admission(now, now + 2.5, 1, level=1)
        with pytest.raises(Exception, match="cannot meet the request's deadline"):
            m.batcher.check_admission(now, now + 2.5, 1, level=2)
    finally:
        m.batcher.close()


async def test_low_levels_time_out_at_their_own_deadline_and_delay_keeps_them() -> None:
    clock, log = _Clock(), []
    m = _Model("m", clock, log, priority_levels=3, default_priority_level=3,
               priority_queue_policy={2: {"timeout_action": "DELAY"}})  # fmt: skip
    try:
        m.send(100.0, priority=1)  # runs
        await _passes()
        high = m.send(50.0, priority=1)  # at the top of the queue, a late deadline
        rejected = m.send(5.0)  # level 3 (REJECT, the default)
        delayed = m.send(5.0, priority=2)  # level 2, DELAY
        patient = m.send(50.0)  # level 3, within its deadline
        clock.now += 6.0
        m.pool.finish()  # the pump finds both past their deadline
        assert rejected.future.done()
        with pytest.raises(DeadlineExceeded, match="timed out"):
            rejected.future.result()
        assert not delayed.future.done() and delayed.level == m.batcher.delayed_level
        # Delayed, it comes after every request within its deadline, of any level:
        # here in the same batch (a batch takes what fits), behind both.
        assert m.pool.jobs[-1].requests == [high, patient, delayed]  # type: ignore[attr-defined]
        clock.now += BATCH_S
        m.pool.finish()
        assert delayed.future.result()["Y"].shape == (1, 1)
    finally:
        m.batcher.close()


async def test_a_level_timeout_and_whether_a_request_may_override_it() -> None:
    clock, log = _Clock(), []
    m = _Model("m", clock, log, priority_levels=2, default_priority_level=2, timeout_ms=5000,
               priority_queue_policy={
                   1: {"default_timeout_microseconds": 1_000_000},
                   2: {"default_timeout_microseconds": 9_000_000, "allow_timeout_override": False},
               })  # fmt: skip
    b = m.batcher
    try:
        assert b.timeout_at(1, 5.0, 5.0) == 1.0  # named none: the level's
        assert b.timeout_at(1, 2.0, 5.0) == 2.0  # named 2 s: its own
        assert b.timeout_at(2, 2.0, 5.0) == 9.0  # may not override
    finally:
        b.close()
