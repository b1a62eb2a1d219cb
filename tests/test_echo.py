"""Closed-loop clients, open-loop arrivals and the batcher, on a fake clock.

A small discrete-event simulation drives the real :class:`Batcher` with an
executor of one instance whose batches take ``L(k)`` fake seconds: closed-loop
clients send their next request a return time after their answer; an open
loop sends at seeded exponential gaps. Time moves only when the simulation
says so, so the batches formed do not depend on this machine's speed.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest

from aserve.config import BatchingConfig
from aserve.errors import QueueFull, Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.loop_lag import LoopLag
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.sched.latency import Echoes
from aserve.sched.policy import BatchLimits, Echo, QueueView, plan


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Instance:
    """One instance; a batch of ``k`` ends ``cost(k)`` after it starts (the sim runs it)."""

    def __init__(self, clock: _Clock, cost: Callable[[int], float]) -> None:
        self.clock, self.cost = clock, cost
        self.job = None
        self.ends_at = math.inf
        self.on_live = None
        self.restarts = 0
        self.live = 1
        self.batches: list[tuple[float, int]] = []  # (start, size)

    async def start(self) -> None:
        pass

    async def stop(self, timeout: float = 10.0) -> None:
        pass

    def submit(self, job) -> None:
        assert self.job is None, "one instance: a second batch while one runs"
        self.job, self.ends_at = job, self.clock() + self.cost(job.size)
        self.batches.append((self.clock(), job.size))

    def finish(self) -> None:
        job, self.job, self.ends_at = self.job, None, math.inf
        job.outputs = {"Y": np.concatenate([p["X"] for p in job.parts])}
        job.on_done(job)


class _Sim:
    """The batcher, its instance and the clients, advanced event by event."""

    def __init__(self, cost: Callable[[int], float], max_batch: int = 32,
                 max_delay_ms: float = 5.0, timeout_s: float = 10.0) -> None:  # fmt: skip
        self.clock = _Clock()
        self.pool = _Instance(self.clock, cost)
        config = BatchingConfig(max_batch_size=max_batch, max_delay_ms=max_delay_ms,
                                max_queue_size=1024)  # fmt: skip
        self.batcher = Batcher("m/1", config, self.pool, ModelStats("m", "1"),
                               clock=self.clock, loop_lag=LoopLag())  # fmt: skip
        for k in range(1, max_batch + 1):  # warm-up measured every size
            self.batcher.latency.observe(k, cost(k))
        self.timeout_s = timeout_s
        self.sends: list[tuple[float, int]] = []  # (when, client), pending
        self.requests: dict[InferenceRequest, int] = {}
        self.done: list[InferenceRequest] = []
        self.on_answer: Callable[[int], float | None] = lambda client: None
        self.freed_at = self.clock()  # when the instance last freed up
        self.refused = 0

    def send(self, client: int) -> None:
        loop = asyncio.get_running_loop()
        now = self.clock()
        req = InferenceRequest({"X": np.zeros((1, 1), np.float32)}, 1, (), now,
                               now + self.timeout_s, loop.create_future(), None, None)  # fmt: skip
        try:
            self.batcher.submit(req)
        except (QueueFull, Unavailable):
            self.refused += 1
            return
        self.requests[req] = client

    async def run(self, batches: int = 0, drain: bool = False) -> None:
        """Until ``batches`` have started, or (``drain``) until nothing is left to happen."""
        while drain or len(self.pool.batches) < batches:
            timer = self.batcher._timer_at if self.batcher._timer is not None else math.inf
            at = min(self.pool.ends_at, min(self.sends, default=(math.inf, 0))[0], timer)
            if drain and at > self.clock() + 1.0:
                return  # only the deadline timers of no request are left
            assert at < math.inf, "nothing left to happen"
            self.clock.now = max(self.clock.now, at)
            if at == self.pool.ends_at:
                self.freed_at = self.clock()
                self.pool.finish()
                for req, client in list(self.requests.items()):
                    if req.future.done():
                        del self.requests[req]
                        self.done.append(req)
                        back = self.on_answer(client)
                        if back is not None:
                            self.sends.append((self.clock() + back, client))
            elif self.sends and at == min(self.sends)[0]:
                self.sends.sort()
                while self.sends and self.sends[0][0] <= self.clock():
                    self.send(self.sends.pop(0)[1])
            else:
                self.batcher._on_timer()  # the batcher's timer, on its clock
            await asyncio.sleep(0)  # the pumps the batcher scheduled

    def mean_batch(self, last: int) -> float:
        sizes = [k for _, k in self.pool.batches[-last:]]
        return sum(sizes) / len(sizes)


def _closed_loop(sim: _Sim, groups: list[int], return_ms: Callable[[int], float]) -> None:
    """Closed-loop clients, in ``groups`` that send their first requests 1 ms apart
    (1 us apart within a group: two arrivals at one instant make an infinite rate):
    client ``i`` sends again ``return_ms(i)`` after its answer (a spread of return
    times: answers are written, and requests parsed, one after another)."""
    sim.on_answer = lambda client: return_ms(client) / 1000
    client = 0
    for g, size in enumerate(groups):
        for _ in range(size):
            sim.sends.append((sim.clock() + g * 1e-3 + client * 1e-6, client))
            client += 1


def _spread(client: int) -> float:
    return 0.4 + 0.1 * client  # 0.4 ms .. 1.9 ms for 16 clients


def _affine(per_batch_ms: float, per_item_ms: float) -> Callable[[int], float]:
    return lambda k: (per_batch_ms + per_item_ms * k) / 1000


async def test_closed_loop_of_16_runs_batches_of_16_when_they_pay():
    """16 closed-loop clients on a model whose batch of 16 costs less per item than
    smaller ones (10 ms + 4 ms an item). The first request finds the instance idle
    and runs alone, the other 15 queue behind it; the queue must not stay split in
    groups that take turns (1 and 15 here; 2 and 14, or 8 and 8, in the c=16 runs):
    the mean rate spreads the 16 over the cycle and says that waiting never pays."""
    sim = _Sim(_affine(10.0, 4.0))
    _closed_loop(sim, [8, 8], _spread)
    await sim.run(80)
    assert sim.mean_batch(50) >= 0.9 * 16
    # Held for company never past max_delay after the instance could run them, and
    # never past a deadline.
    assert all(r.future.exception() is None for r in sim.done)


async def test_closed_loop_waits_only_when_the_bigger_batch_pays():
    """The same clients on a model whose time grows in step with the batch (5 ms an
    item): a batch of 16 saves nothing over two of 8, and the wait for the returning
    clients would cost the instance's time. The groups keep taking turns."""
    sim = _Sim(_affine(0.0, 5.0))
    _closed_loop(sim, [8, 8], _spread)
    await sim.run(60)
    assert sim.mean_batch(40) == pytest.approx(8.0)
    # Never held: each batch starts the moment the one before ends.
    pairs = pairwise(sim.pool.batches[-40:])
    assert all(b == pytest.approx(a + 0.005 * k) for (a, k), (b, _) in pairs)


async def test_closed_loop_does_not_wait_for_clients_that_return_as_slowly_as_a_batch_runs():
    """The same model and clients, behind a front that takes 1 ms of its own for each
    returning request (it parses and tokenizes them one by one while the instance
    runs): after a batch of 15 its clients are back only 15 ms later. Running the one
    waiting now overlaps that (14 ms, then the 15), waiting would idle the instance
    for it: even with a max_delay that allows the wait, the groups keep taking turns,
    and the instance never idles while requests wait."""
    sim = _Sim(_affine(10.0, 4.0), max_delay_ms=50.0)
    _closed_loop(sim, [8, 8], lambda client: 0.0)
    answered: list[int] = []
    front_free = [0.0]

    def answer(client: int) -> float:
        # One front: each returning request takes 1 ms of it, one after another.
        front_free[0] = max(front_free[0], sim.clock()) + 0.001
        answered.append(client)
        return front_free[0] - sim.clock()

    sim.on_answer = answer
    await sim.run(60)
    assert sim.mean_batch(40) == pytest.approx(8.0)
    pairs = pairwise(sim.pool.batches[-40:])
    assert all(b == pytest.approx(a + 0.010 + 0.004 * k) for (a, k), (b, _) in pairs)


async def test_the_echo_wait_ends_by_max_delay_and_a_client_that_left_is_not_awaited():
    """16 clients, one of which leaves for good: the batcher waits for the 15 that
    come back, not for the 16th; and no request is held for company (an instance
    free, it queued) longer than max_delay."""
    sim = _Sim(_affine(10.0, 4.0))
    gone = set()
    _closed_loop(sim, [16], _spread)

    def answer(client: int) -> float | None:
        if len(sim.pool.batches) > 40 and not gone:
            gone.add(client)
            return None
        return None if client in gone else _spread(client) / 1000

    sim.on_answer = answer
    holds: list[float] = []
    batcher_dispatch = sim.batcher._dispatch

    def dispatch(picked, now):
        for r in picked:  # held for company: from its arrival or the instance's freeing
            holds.append(now - max(r.arrival, sim.freed_at))
        batcher_dispatch(picked, now)

    sim.batcher._dispatch = dispatch
    await sim.run(100)
    assert len(gone) == 1
    assert sim.mean_batch(40) == pytest.approx(15.0)
    assert max(holds) <= 0.005 + 1e-9
    # Each batch of 15 starts once the 15th is back: no wait for the one that left.
    starts = [t for t, _ in sim.pool.batches[-40:]]
    cycle = 0.010 + 0.004 * 15 + _spread(15) / 1000
    assert all(b - a <= cycle + 1e-9 for a, b in pairwise(starts))


@pytest.mark.parametrize(
    ("rate", "timeout_s"),
    [(200.0, 10.0), (600.0, 10.0), (700.0, 0.2), (1200.0, 0.2)],
)
async def test_open_loop_arrivals_batch_as_without_the_echo(monkeypatch, rate, timeout_s):
    """Poisson arrivals (seeded) at a moderate and a high load, and at 3x and 5x what
    the model serves with a 200 ms deadline each (admission refuses most): the batches
    formed are the same, batch for batch, with the echo's forecast or without it.
    Under overload the admitted requests come in a wave after each batch end (the
    queue ahead is gone): admission's echo, not the clients', and nothing to wait for;
    the refused ones count as arrivals too, so the wave is no excess."""

    async def batches(echo: bool) -> list[tuple[float, int]]:
        if not echo:
            monkeypatch.setattr(Echoes, "_forecast", lambda *a: None)
        sim = _Sim(_affine(10.0, 4.0), timeout_s=timeout_s)
        rng = random.Random(7)
        t = sim.clock()
        for i in range(int(rate * 2)):
            t += rng.expovariate(rate)
            sim.sends.append((t, i))
        await sim.run(drain=True)
        monkeypatch.undo()
        assert len(sim.done) + sim.refused == int(rate * 2)
        assert (sim.refused > rate) == (timeout_s < 1)
        return sim.pool.batches

    assert await batches(echo=True) == await batches(echo=False)


def test_echoes_learn_a_closed_loop_and_not_an_open_one():
    max_delay = 0.005
    window = 2 * max_delay  # an echo is counted over twice max_delay after an end
    echoes = Echoes()
    t = 10.0
    for _ in range(30):  # each batch of 8 brings its 8 back within 0.4-1.1 ms
        echoes.ended(t, 8, max_delay)
        for i in range(8):
            echoes.arrived(t + (0.4 + 0.1 * i) / 1000)
        t += 0.040
    assert echoes.ratio == pytest.approx(1.0, abs=0.01)
    echoes.ended(t, 8, max_delay)
    echoes.arrived(t + 0.0004)
    forecast = echoes.expected(t + 0.0004)
    assert forecast is not None and forecast.items == 7
    assert forecast.due == pytest.approx(t + 0.0011, abs=1e-4)
    assert t + 0.0011 <= forecast.by <= t + window
    assert forecast.since == t
    assert echoes.expected(t + window + 1e-6) is None  # its window is over

    # In turns of 1 (12 ms) and 15 (63 ms): the 15 come back 6 ms after their end,
    # while the batch of 1 runs; they are no background of the end of that batch.
    echoes = Echoes()
    t = 10.0
    for _ in range(30):
        echoes.ended(t, 15, max_delay)
        for i in range(15):
            echoes.arrived(t + 0.006 + i * 1e-5)
        t += 0.012
        echoes.ended(t, 1, max_delay)
        echoes.arrived(t + 0.0016)
        t += 0.063
    assert echoes.ratio == pytest.approx(1.0, abs=0.01)

    rng = random.Random(3)
    echoes = Echoes()
    t = arrival = 10.0
    for _ in range(300):  # 1000/s arriving regardless of the batches' ends
        end = t + 0.020
        while arrival < end:
            echoes.arrived(arrival)
            arrival += rng.expovariate(1000.0)
        echoes.ended(end, 20, max_delay)
        t = end
    assert abs(echoes.ratio) < 0.1
    assert echoes.expected(t) is None and echoes.after(t + 0.02, 20) is None


def test_the_echo_rule_keeps_max_delay_and_the_deadline():
    limits = BatchLimits.build(max_batch_size=32, max_delay_ms=5.0, preferred=[])
    cost = _affine(10.0, 4.0)
    now = 10.0
    echo = Echo(items=8, due=now + 0.001, by=now + 0.002, since=now)
    queue = QueueView(8, now - 0.040, now + 1.0)  # queued 40 ms behind the last batch
    assert plan(now, queue, 1, limits, cost, 0.0) == plan(now, queue, 1, limits, cost, 0.0, None)
    assert plan(now, queue, 1, limits, cost, 0.0).take == 8  # rule 5: waited max_delay
    assert plan(now, queue, 1, limits, cost, 0.0, echo).wake_at == pytest.approx(now + 0.002)
    late = Echo(items=8, due=now + 0.006, by=now + 0.007, since=now)
    assert plan(now, queue, 1, limits, cost, 0.0, late).take == 8  # not within max_delay
    near = QueueView(8, now - 0.040, now + 0.002 + cost(16) - 1e-4)  # 16 by the deadline
    assert plan(now, near, 1, limits, cost, 0.0, echo).wake_at == pytest.approx(now + 0.0019)
    nearer = QueueView(8, now - 0.040, now + 0.001 + cost(16) - 1e-4)  # not if they are due
    assert plan(now, nearer, 1, limits, cost, 0.0, echo).take == 8
    linear = _affine(0.0, 5.0)  # a batch of 16 costs two of 8: waiting does not pay
    assert plan(now, queue, 1, limits, linear, 0.0, echo).take == 8
    preferred = BatchLimits.build(max_batch_size=32, max_delay_ms=5.0, preferred=[8, 12])
    few = QueueView(2, now - 0.040, now + 1.0)
    assert plan(now, few, 1, preferred, cost, 0.0, echo).take == 0  # for 8, rule 3's size
