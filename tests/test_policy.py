"""The batching policy and estimates, driven with plain numbers (a fake clock)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from aserve.config import BatchingConfig
from aserve.errors import DeadlineExceeded, Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.loop_lag import LoopLag
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.sched.latency import AdmissionMargin, ArrivalRate, LatencyModel
from aserve.sched.policy import BatchLimits, Plan, QueueView, plan, predicted_finish
from aserve.workers.job import BatchJob, Executor

LIMITS = BatchLimits.build(max_batch_size=32, max_delay_ms=5.0, preferred=[8, 16, 32])


def fixed_cost(per_batch: float, per_item: float):
    return lambda n: per_batch + per_item * n


def view(items, now=10.0, waited=0.0, deadline_in=1.0):
    return QueueView(items, now - waited, now + deadline_in)


def test_nothing_runs_without_a_free_instance_or_without_requests():
    assert plan(10.0, view(40), 0, LIMITS, fixed_cost(1e-3, 0), 1e4) == Plan(0, None)
    assert plan(10.0, view(0), 1, LIMITS, fixed_cost(1e-3, 0), 1e4) == Plan(0, None)


def test_full_queue_runs_max_batch():
    assert plan(10.0, view(40), 1, LIMITS, fixed_cost(1e-3, 0), 0.0).take == 32


def test_largest_preferred_size_that_fits():
    assert plan(10.0, view(20), 1, LIMITS, fixed_cost(1e-3, 0), 1e6).take == 16
    assert plan(10.0, view(8), 1, LIMITS, fixed_cost(1e-3, 0), 1e6).take == 8


def test_idle_server_runs_a_lone_request_at_once():
    # No arrivals to wait for: waiting cannot pay, whatever the cost curve.
    assert plan(10.0, view(1), 1, LIMITS, fixed_cost(1e-3, 1e-5), 0.0).take == 1


def test_waits_when_arrivals_fill_a_batch_that_pays():
    # Fixed per-batch cost dominates; 3 items waiting, 5 more arrive within 0.5 ms.
    p = plan(10.0, view(3), 1, LIMITS, fixed_cost(2e-3, 1e-5), 10_000.0)
    assert p.take == 0
    assert p.wake_at == pytest.approx(10.0 + 5 / 10_000.0)


def test_does_not_wait_when_cost_grows_in_step_with_the_batch():
    # Per-item cost dominates: a bigger batch saves nothing, so no waiting.
    p = plan(10.0, view(3), 1, LIMITS, fixed_cost(1e-6, 1e-3), 10_000.0)
    assert p.take == 3


def test_does_not_wait_past_max_delay():
    # Arrivals too slow to fill the next size within max_delay.
    assert plan(10.0, view(3), 1, LIMITS, fixed_cost(2e-3, 0), 100.0).take == 3
    # The oldest request has already waited max_delay.
    assert plan(10.0, view(3, waited=0.006), 1, LIMITS, fixed_cost(2e-3, 0), 1e6).take == 3


def test_does_not_wait_when_the_deadline_would_miss():
    # Deadline 2.5 ms away, running takes 2 ms: waiting 0.5 ms+ would miss it.
    p = plan(10.0, view(3, deadline_in=0.0025), 1, LIMITS, fixed_cost(2e-3, 0), 1e4)
    assert p.take == 3
    # Wake-up never later than the latest moment the deadline allows.
    p = plan(10.0, view(3, deadline_in=0.0030), 1, LIMITS, fixed_cost(2e-3, 0), 2e3)
    assert p.take == 3 or p.wake_at <= 10.0 + 0.0030 - 2e-3


def test_nothing_measured_runs_at_once():
    assert plan(10.0, view(3), 1, LIMITS, lambda n: 0.0, 1e6).take == 3


def test_predicted_finish_counts_queue_ahead_and_instances():
    lat = fixed_cost(0.010, 0.0)  # 10 ms per batch of any size
    # Empty queue, instance free: one batch.
    assert predicted_finish(0.0, 0, 1, 1, 0.0, LIMITS, lat) == pytest.approx(0.010)
    # 64 items ahead (two full batches) on one instance busy until t=5 ms.
    assert predicted_finish(0.0, 64, 1, 1, 0.005, LIMITS, lat) == pytest.approx(0.035)
    # The same on two instances: the full batches run side by side.
    assert predicted_finish(0.0, 64, 1, 2, 0.005, LIMITS, lat) == pytest.approx(0.025)


def test_latency_model_interpolates_and_extrapolates():
    lat = LatencyModel(32)
    assert not lat.known and lat.estimate(4) == 0.0
    lat.observe(1, 1.0)
    lat.observe(8, 8.0)
    assert lat.known
    assert lat.estimate(4) == pytest.approx(4.0)  # between measured sizes
    assert lat.estimate(16) == pytest.approx(16.0)  # per-item cost of the largest
    lat.observe(8, 18.0)  # EWMA moves toward new measurements
    assert 8.0 < lat.estimate(8) < 18.0


def test_arrival_rate_follows_bursts_and_silence():
    rate = ArrivalRate()
    assert rate.per_second(0.0) == 0.0
    t = 0.0
    for _ in range(50):
        t += 0.001
        rate.observe(t)
    assert rate.per_second(t) == pytest.approx(1000.0, rel=0.05)
    # One second of silence: the rate drops at once.
    assert rate.per_second(t + 1.0) == pytest.approx(1.0, rel=0.01)
    rate.observe(t + 1.0)
    assert rate.per_second(t + 1.0) < 2.0
    assert not math.isinf(rate.per_second(t + 1.0))


def test_one_outlier_moves_an_estimate_at_most_twofold():
    lat = LatencyModel(8)
    lat.observe(1, 0.001)
    lat.observe(1, 10.0)  # a huge input on a variable-shape model
    assert lat.estimate(1) == pytest.approx(0.002)
    for _ in range(20):  # a lasting change still takes over
        lat.observe(1, 0.5)
    assert lat.estimate(1) == pytest.approx(0.5, rel=0.05)


def test_no_batch_runs_past_the_earliest_deadline_in_the_queue():
    cost = fixed_cost(5e-3, 1e-3)  # 5 ms + 1 ms per item
    plain = BatchLimits.build(max_batch_size=32, max_delay_ms=5.0, preferred=[])
    # 20.5 ms left: 15 items end in 20 ms, 16 would not; a full batch (37 ms) would miss all.
    assert plan(10.0, view(40, deadline_in=0.0205), 1, plain, cost, 0.0).take == 15
    # With preferred sizes, the largest one within the cap.
    assert plan(10.0, view(40, deadline_in=0.0205), 1, LIMITS, cost, 0.0).take == 8
    # Not even one fits: still one (the rest of the queue may have time).
    assert plan(10.0, view(40, deadline_in=0.001), 1, plain, cost, 0.0).take == 1
    # Time enough: the full batch.
    assert plan(10.0, view(40, deadline_in=1.0), 1, plain, cost, 0.0).take == 32
    # Fewer waiting than the cap: the usual rules (rule 5, the deadline is near).
    assert plan(10.0, view(10, deadline_in=0.0205), 1, plain, cost, 1e3).take == 10


def test_admission_counts_batches_capped_by_the_deadline():
    cost = fixed_cost(5e-3, 1e-3)
    plain = BatchLimits.build(max_batch_size=32, max_delay_ms=5.0, preferred=[])
    # 30 ahead + 1: without a deadline one batch of 31 (36 ms). With 40 ms left,
    # batches are sized to half of it (the queue's older requests have less):
    # 20 ms per batch, so 15 + 15 + 1 on one instance = 20 + 20 + 6 ms.
    assert predicted_finish(0.0, 30, 1, 1, 0.0, plain, cost) == pytest.approx(0.036)
    assert predicted_finish(0.0, 30, 1, 1, 0.0, plain, cost, deadline=0.040) == pytest.approx(0.046)


def test_what_load_taught_the_estimates_fades_while_the_model_is_idle():
    """Batches slowed by a busy machine must not leave estimates that an idle server,
    refusing on them, never gets to correct: over idle time each estimate's excess over
    the lowest it has been, and the jitter, halve every idle half-life."""
    lat = LatencyModel(8, idle_half_life=1.0)
    lat.observe(4, 0.040)  # measured quiet (warm-up)
    for i in range(40):
        lat.observe(4, 0.080 if i % 2 else 0.240)  # a storm: slow and erratic
    slow, stretch = lat.estimate(4), lat.stretch
    assert slow > 0.120 and stretch > 1.3
    lat.relax(1.0)
    assert lat.estimate(4) == pytest.approx(0.040 + (slow - 0.040) / 2)
    assert lat.stretch == pytest.approx(1.0 + (stretch - 1.0) / 2)
    lat.relax(9.0)
    assert lat.estimate(4) == pytest.approx(0.040, rel=0.01)
    lat.relax(0.0)  # no idle time, no change
    assert lat.estimate(4) == pytest.approx(0.040, rel=0.01)
    lat.observe(2, 0.200)  # a size first run in a storm: no quiet time of its own
    lat.relax(10.0)
    assert lat.estimate(2) == pytest.approx(0.040, rel=0.01)  # no longer than 4 at its best


def test_a_size_first_run_in_a_storm_fades_to_the_quiet_curve():
    """Warm-up measures a few sizes; a storm's batches run other sizes for the first
    time, slowly (4: 110 ms on a model whose warm-up did 1 in 30 ms and 32 in 90 ms).
    Their floor is the warm-up curve's (36 ms for 4), so a rest brings them back to it:
    with the floor at their own first time, or 32's, a burst seconds after the storm
    was predicted at ~2x what it took, and refused."""
    lat = LatencyModel(32, idle_half_life=1.0)
    lat.observe(1, 0.030)
    lat.observe(32, 0.090)
    lat.observe(4, 0.110)
    lat.observe(4, 0.120)
    lat.relax(3.0)
    assert lat.estimate(4) < 0.050
    lat.relax(10.0)
    assert lat.estimate(4) == pytest.approx(0.030 + 3 * 0.060 / 31, rel=0.01)


def test_high_estimate_widens_with_the_jitter_of_batches():
    lat = LatencyModel(8)
    for _ in range(30):
        lat.observe(4, 0.040)
    assert lat.high(4) == pytest.approx(lat.estimate(4), rel=1e-3)  # steady: no widening
    for i in range(60):
        lat.observe(4, 0.030 if i % 2 else 0.050)  # +-25% around the mean
    assert lat.estimate(4) == pytest.approx(0.040, rel=0.1)
    assert 0.047 < lat.high(4) < 0.053  # what the slow half took
    for _ in range(31):
        lat.observe(4, 0.040)
    lat.observe(4, 0.400)  # one stall in the window: not the slowest tenth
    assert lat.stretch < 1.05  # (it moved the mean, by at most 2x, not the stretch)
    for _ in range(40):
        lat.observe(4, 0.040 * 2.0**_)  # ever slower: bounded at 3x the estimate
    assert lat.high(4) == pytest.approx(3.0 * lat.estimate(4))


class FakeClock:
    """The batcher's clock in these tests: time moves only when the test says so."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_admission_margin_rises_once_per_burst_and_decays_with_successes():
    clock = FakeClock()  # time's own decay is out of the way here: a half-life of years
    margin = AdmissionMargin(raise_by=0.25, lower_by=0.01, min_half_life=1e9, clock=clock)
    now = clock()
    margin.served(now, 50)
    assert margin.factor == 1.0  # never below 1: an unloaded server admits on the prediction
    for i in range(8):  # one slow batch fails 8 requests within one deadline's length
        margin.missed(now + 0.001 * i, hold=0.2, ratio=4.0)
    assert margin.factor == pytest.approx(1.25)
    margin.missed(now + 0.3, hold=0.2, ratio=4.0)  # a miss after the hold raises again
    assert margin.factor == pytest.approx(1.25**2)
    for _ in range(10):
        margin.served(now)
    assert margin.factor == pytest.approx(1.25**2 * 0.99**10)
    margin.served(now, 1000)
    assert margin.factor == 1.0
    for i in range(100):
        margin.missed(now + 1.0 + 0.3 * i, hold=0.2, ratio=100.0)
    assert margin.factor == pytest.approx(4.0)  # capped


def test_admission_margin_fades_with_time_alone():
    """A server that serves nothing (it refuses all, or nothing comes) still forgets an
    old overload: the excess over 1 halves every half-life, which is four of the last
    miss's budgets, at least ``min_half_life``."""
    clock = FakeClock()
    margin = AdmissionMargin(min_half_life=2.0, clock=clock)
    margin.factor = 3.0
    clock.now += 2.0
    assert margin.factor == pytest.approx(2.0)
    clock.now += 20.0
    assert margin.factor == pytest.approx(1.0 + 2.0 * 0.5**11)
    margin.factor = 3.0
    margin.missed(clock(), hold=5.0, ratio=5.0)  # long deadlines: a longer memory
    clock.now += 20.0
    assert margin.factor == pytest.approx(1.0 + 2.75 * 0.5)


def test_admission_margin_never_exceeds_what_misses_showed():
    """Misses by 10% over the prediction justify a margin of about 1.1 (one raise of 25%
    above it, since a miss's time is cut at its deadline), however many there are."""
    clock = FakeClock()
    margin = AdmissionMargin(clock=clock)
    for _ in range(40):
        clock.now += 0.3  # past each hold: every miss may raise
        margin.missed(clock(), hold=0.2, ratio=1.1)
    assert 1.2 < margin.factor <= 1.1 * 1.25 + 1e-9
    clock.now += 0.3
    margin.missed(clock(), hold=0.2)  # a miss without a prediction shows nothing
    assert margin.factor <= 1.1 * 1.25 + 1e-9
    margin.served(clock(), 1, ratio=2.0)  # served, but twice as late as predicted
    for _ in range(3):
        clock.now += 0.3
        margin.missed(clock(), hold=0.2, ratio=1.0)
    assert 1.9 < margin.factor <= 2.0


class _Held:
    """An Executor the test drives: one instance, and a batch runs (Y = X) only when
    the test answers it. No thread: the batcher and its executor share the loop."""

    def __init__(self) -> None:
        self.jobs: list[BatchJob] = []
        self.sizes: list[int] = []  # the batches answered, in order
        self.on_live = None
        self.restarts = 0
        self.live = 1

    async def start(self) -> None:
        pass

    async def stop(self, timeout: float = 10.0) -> None:
        pass

    def submit(self, job: BatchJob) -> None:
        self.jobs.append(job)

    def answer(self) -> None:
        """Run and answer the oldest batch."""
        job = self.jobs.pop(0)
        job.outputs = {"Y": np.concatenate([p["X"] for p in job.parts])}
        self.sizes.append(job.size)
        job.on_done(job)


async def _one_pass() -> None:
    await asyncio.sleep(0)  # one pass of the loop: the batcher pumps with call_soon


def _request(clock: FakeClock, deadline_in: float) -> InferenceRequest:
    loop = asyncio.get_running_loop()
    now = clock()
    return InferenceRequest({"X": np.zeros((1, 1), np.float32)}, 1, (), now, now + deadline_in,
                            loop.create_future(), None, None)  # fmt: skip


async def test_the_margin_stretches_only_waits_in_a_lasting_overload():
    """An old margin must not make a model whose load fell refuse what it can serve: a
    request that is the first of the next batch to start (at once, or behind the running
    one), or that came in a spell that started after a rest at least as long as its
    budget (a burst), is admitted on the prediction alone; one that would wait with
    others in a server busy for longer, or rested only between an overload's batches,
    has its prediction stretched by the margin."""
    clock = FakeClock()
    pool = _Held()
    batcher = Batcher("m/1", BatchingConfig(max_batch_size=4), pool, ModelStats("m", "1"),
                      clock=clock, loop_lag=LoopLag())  # fmt: skip
    for size in (1, 4):
        batcher.latency.observe(size, 0.050)
    batcher.margin.factor = 4.0  # left high by an earlier overload
    clock.now += 1.0  # and the server has rested since
    now = clock()
    batcher.check_admission(now, now + 0.100, 1)  # idle: 50 ms of 100, admitted
    ahead = [_request(clock, 1.0) for _ in range(4)]
    for r in ahead:
        batcher.submit(r)  # a full batch queued (dispatched on the next loop pass)
    batcher.check_admission(now, now + 0.150, 1)  # would wait, but came with `ahead`
    clock.now += 0.2  # busy for longer than the next one's budget: a lasting overload
    now = clock()
    with pytest.raises(Unavailable, match="cannot meet the request's deadline"):
        batcher.check_admission(now, now + 0.150, 1)  # with the queue: ~4 x 100 ms
    await _one_pass()
    assert len(pool.jobs) == 1  # the full batch runs; the queue is empty
    # Behind the running batch, in the next one: 50 + 50 ms of 150, whatever the margin.
    batcher.check_admission(now, now + 0.150, 1)
    pool.answer()
    assert all(r.future.done() for r in ahead)
    clock.now += 0.01  # a moment idle between batches
    later = [_request(clock, 1.0) for _ in range(4)]
    for r in later:
        batcher.submit(r)
    now = clock()
    with pytest.raises(Unavailable, match="cannot meet the request's deadline"):
        batcher.check_admission(now, now + 0.150, 1)  # still the overload's margin
    batcher.margin.factor = 1.0
    batcher.check_admission(now, now + 0.150, 1)  # two batches: 100 ms of 150
    await _one_pass()
    pool.answer()
    assert all(r.future.done() for r in later)


async def test_an_idle_server_admits_a_burst_it_can_serve_after_a_storm():
    """A storm of misses raises the margin, and its slow batches the latency estimates and
    their spread; seconds later 32 requests sent together, which one batch serves well
    within their deadline, are all admitted and served."""
    clock = FakeClock()
    pool = _Held()
    config = BatchingConfig(max_batch_size=32, max_delay_ms=0, max_queue_size=1024)
    batcher = Batcher("m/1", config, pool, ModelStats("m", "1"), clock=clock, loop_lag=LoopLag())
    for size in range(1, 33):  # 28 ms + 1 ms per item: a batch of 32 in 60 ms
        batcher.latency.observe(size, 0.028 + 0.001 * size)
    busy = _request(clock, 60.0)
    batcher.submit(busy)  # holds the only instance through the storm
    await _one_pass()
    assert len(pool.jobs) == 1
    for _ in range(6):  # six rounds of admitted requests that all miss (the model stalls)
        missed = [_request(clock, 0.2) for _ in range(8)]
        for r in missed:
            batcher.submit(r)
        clock.now += 0.3
        batcher._on_timer()  # the deadline timer, on the batcher's clock
        for r in missed:
            with pytest.raises(DeadlineExceeded):
                r.future.result()
    stormy = batcher.margin.factor
    assert stormy > 2.0
    for _ in range(20):  # and the batches that did run were slow and erratic (a busy CPU)
        for size, slow in ((1, 3.0), (2, 5.0), (4, 2.0), (8, 4.0)):
            batcher.latency.observe(size, slow * (0.028 + 0.001 * size))
    pool.answer()
    assert busy.future.done()
    clock.now += 3.0  # idle for a few seconds
    burst = [_request(clock, 0.2) for _ in range(32)]
    for r in burst:
        batcher.submit(r)  # none refused
    await _one_pass()
    pool.answer()
    assert all(r.future.done() and r.future.exception() is None for r in burst)
    assert pool.sizes[-1] == 32  # one batch
    assert batcher.margin.factor < stormy  # and the margin fades
    batcher.close()


def test_loop_lag_counts_a_lasting_lag_and_forgets_a_single_pause():
    lag = LoopLag(rise=0.3, fall=0.1)
    lag.observe(0.050)  # one pause counts for a fraction of itself
    assert lag.recent == pytest.approx(0.015)
    for _ in range(40):
        lag.observe(0.0)
    assert lag.recent < 0.0005
    for _ in range(10):  # a lasting lag
        lag.observe(0.060)
    assert lag.recent == pytest.approx(0.060, rel=0.05)


async def test_admission_counts_the_event_loops_lag_once():
    """A loop that runs its callbacks 60 ms late delays a request's answer before it is
    written: 50 ms of model time then needs 110 ms. Its wait before the handler ran is
    over when admission looks (the deadline starts there): counted too, the lag made a
    storm's loop refuse what it could answer in time."""
    clock = FakeClock()
    lag = LoopLag()
    pool = _Held()
    batcher = Batcher("m/1", BatchingConfig(max_batch_size=4), pool, ModelStats("m", "1"),
                      clock=clock, loop_lag=lag)  # fmt: skip
    batcher.latency.observe(1, 0.050)
    now = clock()
    batcher.check_admission(now, now + 0.100, 1)  # a prompt loop: admitted
    for _ in range(30):
        lag.observe(0.060)
    with pytest.raises(Unavailable, match=r"with the event loop's lag of 60\.0 ms"):
        batcher.check_admission(now, now + 0.100, 1)  # 110 ms of 100
    batcher.check_admission(now, now + 0.120, 1)  # 110 ms of 120: admitted


async def test_a_storms_erratic_batches_leave_the_next_batch_open():
    """In a retry storm batches of one ran 30-60 ms, erratically, misses raised the
    margin and the loop lagged 30 ms: a request behind the running batch, with nothing
    queued, was predicted at 3x the batch's estimate twice over, times the margin, plus
    twice the lag (340 ms), so only a request that found the instance idle was admitted,
    it ran alone, and the instance idled until the next one came. Work-conserving
    admission takes the first of the next batch on what batches took (the slowest tenth
    of them: about 70 + 70 ms and the lag, within 200 ms); those that would join it get
    the margin, and as it fades the next batch fills."""
    clock = FakeClock()
    lag = LoopLag()
    pool = _Held()
    config = BatchingConfig(max_batch_size=32, max_delay_ms=0, max_queue_size=1024)
    batcher = Batcher("m/1", config, pool, ModelStats("m", "1"), clock=clock, loop_lag=lag)
    for size in range(1, 33):  # warm-up: 28 ms + 1 ms per item
        batcher.latency.observe(size, 0.028 + 0.001 * size)
    for i in range(40):  # the storm's batches of one: slow and erratic
        batcher.latency.observe(1, 0.060 if i % 2 else 0.030)
    batcher.margin.factor = 2.0  # raised by the storm's misses
    for _ in range(30):
        lag.observe(0.030)
    running = _request(clock, 0.2)
    batcher.submit(running)
    await _one_pass()
    assert len(pool.jobs) == 1  # it holds the only instance
    clock.now += 0.010
    now = clock()
    with pytest.raises(Unavailable, match="0 request"):
        batcher.check_admission(now, now + 0.100, 1)  # too short for two batches: refused
    first = _request(clock, 0.2)
    batcher.submit(first)  # nothing queued: admitted, whatever the margin
    with pytest.raises(Unavailable, match="1 request"):
        batcher.check_admission(now, now + 0.200, 1)  # joining it: ~2 x 110 ms, refused
    batcher.margin.factor = 1.3  # the margin fades
    joined = [_request(clock, 0.2) for _ in range(7)]
    for r in joined:
        batcher.submit(r)  # none refused
    await _one_pass()
    assert len(pool.jobs) == 1  # they wait for the instance
    pool.answer()
    pool.answer()
    assert all(r.future.done() and r.future.exception() is None for r in (first, *joined))
    assert pool.sizes == [1, 8]  # the next batch took them all
    batcher.close()


async def test_a_burst_at_a_rested_server_is_admitted_on_one_batch_not_on_half_its_budget():
    """32 requests sent together with 200 ms each, on a model whose batch costs 80 ms +
    2 ms an item (32 in 144 ms): one batch serves them all in time. Admission used to
    size the batches ahead by half the budget (10 items in 100 ms), predicting two or
    more batches, and refused the burst from its 19th request on."""
    clock = FakeClock()
    pool = _Held()
    config = BatchingConfig(max_batch_size=32, max_delay_ms=0, max_queue_size=1024)
    batcher = Batcher("m/1", config, pool, ModelStats("m", "1"), clock=clock, loop_lag=LoopLag())
    for size in (1, 8, 32):
        batcher.latency.observe(size, 0.080 + 0.002 * size)
    clock.now += 5.0  # rested
    burst = [_request(clock, 0.2) for _ in range(32)]
    for r in burst:
        batcher.submit(r)  # none refused
    await _one_pass()
    pool.answer()
    assert all(r.future.done() and r.future.exception() is None for r in burst)
    assert pool.sizes == [32]  # one batch


@pytest.mark.parametrize(
    ("head_ms", "shed"),
    [(150, True), (250, False)],  # room for a batch of 1 (of 8 waiting), or of 2
)
async def test_the_head_is_given_up_only_for_a_batch_under_a_quarter_of_the_queue(head_ms, shed):
    clock = FakeClock()
    pool = _Held()
    assert isinstance(pool, Executor)
    config = BatchingConfig(max_batch_size=8, max_delay_ms=0)
    batcher = Batcher("m/1", config, pool, ModelStats("m", "1"), clock=clock, loop_lag=LoopLag())
    busy = _request(clock, 10.0)
    batcher.submit(busy)
    await _one_pass()
    assert len(pool.jobs) == 1  # the busy batch has the only instance
    clock.now += 0.05  # the busy batch has run 50 ms when the others arrive
    head = _request(clock, head_ms / 1000)
    rest = [_request(clock, 10.0) for _ in range(7)]
    for r in (head, *rest):
        batcher.submit(r)
    for size in range(1, 9):  # 100 ms per item, learned only now: all were admitted
        batcher.latency.observe(size, 0.1 * size)
    await _one_pass()
    assert len(pool.jobs) == 1  # they wait for the instance
    pool.answer()  # the busy batch ends now, at +50 ms: the head has head_ms - 50 left
    while pool.jobs:  # the rest run at once, the clock standing still
        pool.answer()
    assert busy.future.done() and all(r.future.done() for r in rest)
    if shed:
        with pytest.raises(DeadlineExceeded, match="enough only for a batch of 1 while 8"):
            head.future.result()
        assert pool.sizes == [1, 7]
    else:
        head.future.result()
        assert pool.sizes[:2] == [1, 2]  # the head, in the batch its time allows
    batcher.close()
