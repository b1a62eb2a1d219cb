"""The shared device's choices, on a fake clock: which model's batch a free slot runs.

Real batchers (one per model, as the server makes them) over pools that hold
each batch until the test ends it, on one :class:`DeviceScheduler`. Every
batch "takes" BATCH_S by the latency tables seeded below, and the clock moves
only when a test moves it, so each choice is the scheduler's alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aserve.config import BatchingConfig, DeviceConfig
from aserve.errors import DeadlineExceeded, Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.device_scheduler import Devices, DeviceScheduler
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.sched.device_policy import Claim, pick
from aserve.workers.job import BatchJob

pytestmark = pytest.mark.timeout(30)

BATCH_S = 1.0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Held:
    """A pool of ``instances`` whose batches stay out until the test ends them."""

    def __init__(self, log: list[tuple[str, int]], name: str, instances: int = 1) -> None:
        self.live = instances
        self.on_live: Any = None
        self.jobs: list[BatchJob] = []
        self._log = log
        self._name = name

    def submit(self, job: BatchJob) -> None:
        self.jobs.append(job)
        self._log.append((self._name, job.size))

    def finish(self) -> None:
        """End the oldest batch out, as an instance would."""
        job = self.jobs.pop(0)
        job.outputs = {"Y": np.zeros((job.size, 1), np.float32)}
        job.on_done(job)


class _Model:
    """A batcher and its held pool."""

    def __init__(
        self, name: str, clock: _Clock, log: list[tuple[str, int]], **batching: Any
    ) -> None:
        self.name = name
        self.clock = clock
        self.pool = _Held(log, name)
        config = BatchingConfig(max_batch_size=4, max_delay_ms=0, **batching)
        self.batcher = Batcher(name, config, self.pool, ModelStats(name, "1"), clock=clock)
        for size in range(1, 5):
            self.batcher.latency.observe(size, BATCH_S)

    def send(self, deadline_in: float, priority: int = 0) -> InferenceRequest:
        loop = asyncio.get_running_loop()
        now = self.clock.now
        req = InferenceRequest({"X": np.zeros((1, 1), np.float32)}, 1, (), now,
                               now + deadline_in, loop.create_future(), None, None)  # fmt: skip
        req.level = self.batcher.level_of(priority)
        self.batcher.submit(req)
        return req


async def _passes() -> None:
    for _ in range(3):  # the batcher pumps with call_soon
        await asyncio.sleep(0)


@pytest.fixture
def log() -> list[tuple[str, int]]:
    return []


def _models(
    clock: _Clock, log: list[tuple[str, int]], device: DeviceScheduler, *names: str, **kw: Any
) -> list[_Model]:
    models = [_Model(n, clock, log, **kw) for n in names]
    for m in models:
        m.batcher.share(device)
    return models


def test_pick_ranks_feasible_then_level_then_deadline() -> None:
    hopeless = Claim(False, 1, 1.0, 1)
    late = Claim(True, 1, 9.0, 2)
    early = Claim(True, 1, 5.0, 3)
    low_early = Claim(True, 2, 2.0, 4)
    assert pick([hopeless, late, early]) == 2
    assert pick([low_early, late]) == 1  # the higher level first, whatever its deadline
    assert pick([hopeless]) == 0
    assert pick([Claim(True, 1, 5.0, 7), Claim(True, 1, 5.0, 6)]) == 1  # first come


async def test_the_free_slot_goes_to_the_earliest_deadline_across_models(log: list) -> None:
    clock = _Clock()
    device = DeviceScheduler("cpu", 1, clock)
    a, b, c = _models(clock, log, device, "a", "b", "c")
    try:
        a.send(100.0)
        await _passes()
        assert log == [("a", 1)] and device.busy == 1
        b.send(50.0)
        c.send(30.0)
        a.send(40.0)
        await _passes()
        assert len(log) == 1 and device.waiting == 2  # one slot: b and c wait (a: its instance)
        clock.now += BATCH_S
        a.pool.finish()
        assert log[-1] == ("c", 1)  # 30 s left, the earliest
        clock.now += BATCH_S
        c.pool.finish()
        assert log[-1] == ("a", 1)  # then a's, at 40 s
        clock.now += BATCH_S
        a.pool.finish()
        assert log[-1] == ("b", 1)
        clock.now += BATCH_S
        b.pool.finish()
        assert device.busy == 0 and device.waiting == 0
    finally:
        for m in (a, b, c):
            m.batcher.close()


async def test_a_model_alone_takes_free_slots_at_once(log: list) -> None:
    clock = _Clock()
    device = DeviceScheduler("cpu", 2, clock)
    a, b = _models(clock, log, device, "a", "b")
    try:
        a.send(10.0)
        b.send(10.0)
        await _passes()
        assert sorted(log) == [("a", 1), ("b", 1)] and device.busy == 2
    finally:
        a.batcher.close()
        b.batcher.close()


async def test_a_hopeless_head_does_not_hold_the_slot(log: list) -> None:
    clock = _Clock()
    device = DeviceScheduler("cpu", 1, clock)
    a, b, c = _models(clock, log, device, "a", "b", "c")
    try:
        a.send(100.0)
        await _passes()
        doomed = c.send(2.5)  # admitted: a second behind a's batch, one for its own
        b.send(50.0)
        await _passes()
        clock.now += 1.6 * BATCH_S  # a's batch ran long: c's request has 0.9 s left
        a.pool.finish()
        assert log[-1] == ("b", 1)  # the one that can still make it
        assert not doomed.future.done()  # it waits for its deadline...
        clock.now += BATCH_S
        b.pool.finish()
        assert log[-1] == ("b", 1) and device.busy == 0  # ...and never runs late
        with pytest.raises(DeadlineExceeded, match="timed out"):
            doomed.future.result()
    finally:
        for m in (a, b, c):
            m.batcher.close()


async def test_higher_priority_first_across_and_within_models_and_low_is_not_starved(
    log: list,
) -> None:
    clock = _Clock()
    device = DeviceScheduler("cpu", 1, clock)
    levels = {"priority_levels": 2, "default_priority_level": 2}
    a, b = _models(clock, log, device, "a", "b", **levels)
    try:
        a.send(100.0)  # occupies the slot
        await _passes()
        low_a = a.send(5.0)  # level 2 (the default), the earliest deadline
        high_b = b.send(80.0, priority=1)
        high_a = a.send(90.0, priority=1)
        await _passes()
        clock.now += BATCH_S
        a.pool.finish()
        assert log[-1] == ("b", 1)  # level 1 at 80 s before level 1 at 90 s and level 2
        clock.now += BATCH_S
        b.pool.finish()
        # a's batch: its level-1 request first, the level-2 one beside it (one model's
        # batch takes what fits of its own queue, in level order).
        assert log[-1] == ("a", 2)
        assert a.pool.jobs[-1].requests == [high_a, low_a]  # type: ignore[attr-defined]
        clock.now += BATCH_S
        a.pool.finish()
        assert high_b.future.done() and high_a.future.done() and low_a.future.done()
    finally:
        a.batcher.close()
        b.batcher.close()


async def test_admission_counts_the_other_models_work_ahead(log: list) -> None:
    clock = _Clock()
    device = DeviceScheduler("cpu", 1, clock)
    a, b = _models(clock, log, device, "a", "b")
    try:
        a.send(100.0)
        await _passes()
        for _ in range(8):  # two full batches of a's, due at 3.2 s
            a.send(3.2)
        await _passes()
        now = clock.now
        # Alone, b would run at once: 1 s. Behind the running batch and a's 8 (two
        # batches of 4, which run first by their earlier deadline), it ends at 4 s.
        with pytest.raises(Unavailable, match="cannot meet the request's deadline"):
            b.batcher.check_admission(now, now + 3.5, 1)
        b.batcher.check_admission(now, now + 4.5, 1)
        # Due before a's queue, it runs before it: behind the running batch only.
        b.batcher.check_admission(now, now + 3.1, 1)
    finally:
        a.batcher.close()
        b.batcher.close()


async def test_reload_changes_slots_and_membership_in_place(log: list) -> None:
    clock = _Clock()
    devices = Devices(clock)
    devices.configure({"cpu": DeviceConfig(scheduling="shared", slots=1)})
    a, b = _Model("a", clock, log), _Model("b", clock, log)

    class _Runtime:
        def __init__(self, m: _Model) -> None:
            self.m = m

        def share(self, device: DeviceScheduler | None) -> None:
            self.m.batcher.share(device)

    placed = [("cpu", _Runtime(a)), ("cpu", _Runtime(b))]
    devices.assign(placed)
    try:
        device = devices.shared["cpu"]
        a.send(50.0)
        b.send(50.0)
        await _passes()
        assert log == [("a", 1)] and device.waiting == 1
        devices.configure({"cpu": DeviceConfig(scheduling="shared", slots=2)})
        assert log == [("a", 1), ("b", 1)]  # the new slot runs b's batch at once
        assert devices.shared["cpu"] is device and device.busy == 2

        devices.configure({})  # the device is no longer shared
        devices.assign(placed)
        assert a.batcher.device is None and b.batcher.device is None
        assert "cpu" not in devices.shared
        # Batches that ran on the slots give them back when they end, and the
        # models now run on their own instances alone.
        a.pool.finish()
        b.pool.finish()
        a.send(50.0)
        b.send(50.0)
        await _passes()
        assert log[-2:] == [("a", 1), ("b", 1)]
    finally:
        a.batcher.close()
        b.batcher.close()
