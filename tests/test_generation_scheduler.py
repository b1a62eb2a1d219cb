"""The continuous batcher: its pure step policy, its loop driver (with a fake step
thread and clock), and the bounded token channel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aserve.config import GenerationConfig
from aserve.errors import DeadlineExceeded, InternalError, QueueFull
from aserve.loop.channel import TokenChannel
from aserve.loop.continuous import ContinuousBatcher, GenerationRequest
from aserve.obs.stats import ModelStats
from aserve.sched.step_policy import RunningView, StepLimits, WaitingView, plan_step
from aserve.types.generation import StepOutput
from aserve.workers.job import StepJob

LIMITS = StepLimits(max_num_seqs=4, max_prefill_tokens=100)


# --- the pure policy -------------------------------------------------------------------


def test_admits_by_deadline_while_slots_and_budget_allow() -> None:
    waiting = [WaitingView(10, 40), WaitingView(11, 40), WaitingView(12, 40), WaitingView(13, 1)]
    plan = plan_step(0, [RunningView(50, False)], [waiting], 1, LIMITS)
    # 40 + 40 fit the 100-token budget, the third would not: admission stops
    # there, and the short fourth does not overtake it.
    assert plan.admit == [(0, 0), (0, 1)] and plan.decode == [0] and plan.wake_at is None


def test_first_admission_ignores_the_budget_and_slots_bound() -> None:
    plan = plan_step(0, [], [[WaitingView(10, 500), WaitingView(11, 1)]], 0, LIMITS)
    assert plan.admit == [(0, 0)]  # a long prompt is never starved
    full = plan_step(0, [RunningView(9, False)] * 4, [[WaitingView(10, 1)]], 4, LIMITS)
    assert full.admit == [] and full.decode == [0, 1, 2, 3]


def test_expired_leave_and_free_their_slots_first() -> None:
    running = [RunningView(5, False), RunningView(50, False)]
    waiting = [WaitingView(4, 3), WaitingView(20, 3)]
    plan = plan_step(10, running, [waiting], 4, LIMITS)
    assert plan.expire_running == [0] and plan.decode == [1]
    # Into the expired one's slot.
    assert plan.expire_waiting == [(0, 0)] and plan.admit == [(0, 1)]


def test_paused_sit_out_and_nothing_to_run_sleeps_until_a_deadline() -> None:
    running = [RunningView(30, True), RunningView(20, True)]
    plan = plan_step(0, running, [[WaitingView(15, 3)]], 4, LIMITS)
    assert not plan.runs and plan.wake_at == 15  # no slot for the waiting one
    assert plan_step(0, [], [], 0, LIMITS).wake_at is None


# The waiting queues by priority: the first is the most urgent (lowest value).


def test_a_more_urgent_queue_is_admitted_first_whatever_the_deadlines() -> None:
    urgent = [WaitingView(90, 10), WaitingView(95, 10)]
    relaxed = [WaitingView(10, 10), WaitingView(11, 10)]
    plan = plan_step(0, [], [urgent, relaxed], 1, LIMITS)  # 3 slots free
    # Both urgent ones, then the relaxed one of the earliest deadline, in that order.
    assert plan.admit == [(0, 0), (0, 1), (1, 0)] and plan.wake_at is None


def test_a_less_urgent_queue_does_not_overtake_where_admission_stops() -> None:
    # The prefill budget: the second urgent one does not fit beside the first,
    # and the short relaxed one, which would, waits behind it.
    urgent = [WaitingView(50, 60), WaitingView(51, 60)]
    plan = plan_step(0, [], [urgent, [WaitingView(20, 1)]], 0, LIMITS)
    assert plan.admit == [(0, 0)]
    # The slots: the one free slot goes to the urgent one, whose deadline is later.
    queues = [[WaitingView(50, 1)], [WaitingView(20, 1)]]
    plan = plan_step(0, [RunningView(80, False)] * 3, queues, 3, LIMITS)
    assert plan.admit == [(0, 0)] and plan.decode == [0, 1, 2]
    # No slot: neither starts; a running sequence is never preempted.
    full = plan_step(0, [RunningView(80, False)] * 4, queues, 4, LIMITS)
    assert full.admit == [] and full.decode == [0, 1, 2, 3] and full.expire_running == []


def test_a_less_urgent_queue_takes_the_slots_the_urgent_one_leaves() -> None:
    # No starvation when there is room: slots the urgent queue does not fill
    # go to the next ones in the same step.
    queues = [[WaitingView(50, 1)], [], [WaitingView(60, 1), WaitingView(61, 1)]]
    assert plan_step(0, [], queues, 0, LIMITS).admit == [(0, 0), (2, 0), (2, 1)]


def test_expired_waiting_ones_leave_from_every_queue() -> None:
    # Slots are full, so nothing is admitted; the expired heads of every
    # priority leave all the same, and only those.
    urgent = [WaitingView(5, 1), WaitingView(30, 1)]
    relaxed = [WaitingView(3, 1), WaitingView(8, 1), WaitingView(12, 1)]
    plan = plan_step(10, [RunningView(40, False)] * 4, [urgent, relaxed], 4, LIMITS)
    assert plan.expire_waiting == [(0, 0), (1, 0), (1, 1)] and plan.admit == []
    # With room, the urgent live one is admitted, and the relaxed live one too.
    plan = plan_step(10, [], [urgent, relaxed], 0, LIMITS)
    assert plan.expire_waiting == [(0, 0), (1, 0), (1, 1)]
    assert plan.admit == [(0, 1), (1, 2)]


def test_with_nothing_to_run_it_wakes_at_the_earliest_head_of_any_queue() -> None:
    running = [RunningView(90, True)] * 4  # every slot held, every reader behind
    plan = plan_step(0, running, [[WaitingView(50, 1)], [WaitingView(20, 1)]], 4, LIMITS)
    # The less urgent queue's head expires first: the batcher must wake for it.
    assert not plan.runs and plan.wake_at == 20
    plan = plan_step(0, running, [[WaitingView(50, 1)], [WaitingView(70, 1)]], 4, LIMITS)
    assert plan.wake_at == 50


# --- the loop driver ------------------------------------------------------------------------


class FakeExecutor:
    """Records submitted steps; the test answers them."""

    def __init__(self) -> None:
        self.jobs: list[StepJob] = []
        self.live = 1
        self.on_live: Any = None

    def submit(self, job: StepJob) -> None:
        self.jobs.append(job)

    def answer(self, finished: set[Any] = frozenset(), error: Exception | None = None) -> StepJob:
        """Complete the last step: one token per sequence, ``finished`` ones end."""
        job = self.jobs[-1]
        if error is not None:
            job.error = error
        else:
            job.outputs = [
                StepOutput(
                    str(s), 7, f"<{s}>", s in finished, "length" if s in finished else None, 3, 1
                )
                for s in [*job.new, *job.running]
            ]
        job.on_done(job)
        return job


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**generation: Any) -> tuple[ContinuousBatcher, FakeExecutor, Clock, ModelStats]:
    executor, clock, stats = FakeExecutor(), Clock(), ModelStats("m", "1")
    config = GenerationConfig(**{"max_num_seqs": 2, "max_prefill_tokens": 100, **generation})
    return ContinuousBatcher("m/1", config, executor, stats, clock), executor, clock, stats


async def settle() -> None:
    await asyncio.sleep(0)  # one pass of the loop: the batcher forms steps with call_soon


async def test_steps_admit_decode_and_finish() -> None:
    b, ex, _, stats = make()
    a = b.submit("a", 10, 60)  # type: ignore[arg-type]  # the fake thread only needs identities
    c = b.submit("c", 10, 50)  # type: ignore[arg-type]
    d = b.submit("d", 10, 70)  # type: ignore[arg-type]
    await settle()
    assert len(ex.jobs) == 1 and ex.jobs[0].new == ["c", "a"]  # deadline order, 2 slots
    assert (b.running, b.waiting, b.slots_held) == (2, 1, 2)
    ex.answer(finished={"c"})
    # c finished inside the step: its slot is free for d at once.
    assert ex.jobs[1].new == ["d"] and ex.jobs[1].running == ["a"]
    ex.answer(finished={"a", "d"})
    assert len(ex.jobs) == 2 and b.idle and b.slots_held == 0
    for req, want in ((a, "<a><a>"), (c, "<c>"), (d, "<d>")):
        text, last = await req.collect()
        assert text == want and last is not None and last.finish_reason == "length"
    assert stats.success.count == 3 and b.step_batch_sizes == {2: 2}


async def test_cancel_frees_the_slot_at_the_next_step() -> None:
    b, ex, _, stats = make()
    a = b.submit("a", 10, 60)  # type: ignore[arg-type]
    x = b.submit("x", 10, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()
    async with x:
        pass  # leaving early cancels (the step with a and x is in flight)
    assert b.running == 1 and stats.cancelled == 1
    ex.answer()
    # The output for x is dropped; the next step frees its slot and decodes a.
    assert ex.jobs[-1].free == ["x"] and ex.jobs[-1].running == ["a"]
    assert b.slots_held == 1
    a.cancel()
    ex.answer()
    assert ex.jobs[-1].free == ["a"] and ex.jobs[-1].running == []
    ex.answer()
    assert b.idle and b.slots_held == 0


async def test_cancel_while_waiting_and_queue_full() -> None:
    b, ex, _, stats = make(max_num_seqs=1, max_queue_size=2)
    b.submit("a", 1, 60)  # type: ignore[arg-type]
    await settle()
    w = b.submit("w", 1, 60)  # type: ignore[arg-type]
    b.submit("v", 1, 60)  # type: ignore[arg-type]
    with pytest.raises(QueueFull, match="max_queue_size 2"):
        b.submit("z", 1, 60)  # type: ignore[arg-type]
    w.cancel()
    assert b.waiting == 1 and stats.cancelled == 1 and stats.rejected["queue_full"] == 1
    ex.answer(finished={"a"})
    assert ex.jobs[-1].new == ["v"]


async def test_a_slow_reader_pauses_only_its_own_sequence() -> None:
    b, ex, _, _ = make(stream_buffer_chunks=2)
    slow = b.submit("slow", 1, 60)  # type: ignore[arg-type]
    fast = b.submit("fast", 1, 60)  # type: ignore[arg-type]
    await settle()
    for _ in range(3):
        ex.answer()
        await anext(fast)  # the fast reader keeps up
    # slow has 2 unread outputs: it sits out, the other goes on.
    assert ex.jobs[-1].running == ["fast"] and slow.channel.paused and b.paused == 1
    ex.answer()
    await anext(fast)
    assert slow.channel.backlog == 2
    delta = await anext(slow)  # reading everything resumes it
    assert delta.text == "<slow><slow>" and delta.token_ids == [7, 7]
    ex.answer()
    assert ex.jobs[-1].running == ["slow", "fast"] and b.paused == 0


async def test_deadline_ends_a_paused_sequence_and_waiting_ones() -> None:
    b, ex, clock, stats = make(max_num_seqs=1, stream_buffer_chunks=1)
    r = b.submit("r", 1, 5)  # type: ignore[arg-type]
    w = b.submit("w", 1, 3)  # type: ignore[arg-type]
    await settle()
    assert ex.jobs[-1].new == ["w"]  # the earlier deadline
    ex.answer()  # w is now 1 output behind: paused; r waits for the slot
    assert len(ex.jobs) == 1 and b._timer is not None
    clock.now += 4  # w expires; r gets its slot
    b._on_timer()
    await settle()
    assert ex.jobs[-1].free == ["w"] and ex.jobs[-1].new == ["r"]
    text, _ = "", None
    with pytest.raises(DeadlineExceeded, match="1 step\\(s\\) unread"):
        async for delta in w:
            text += delta.text
    assert text == "<w>"  # what was produced comes first
    clock.now += 2
    ex.answer()
    with pytest.raises(DeadlineExceeded):
        await r.collect()
    assert stats.timed_out == 2


async def test_a_failed_step_fails_its_requests_and_frees_their_slots() -> None:
    b, ex, _, stats = make()
    a = b.submit("a", 1, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()
    n = b.submit("n", 1, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()  # a decodes, n is admitted
    ex.answer(error=RuntimeError("boom"))
    for req in (a, n):
        with pytest.raises(InternalError, match="boom"):
            await req.collect()
    # The engine freed n's slot when the step failed; a's goes back now.
    assert ex.jobs[-1].free == ["a"] and stats.fail.count == 2
    ex.answer()
    assert b.idle and b.slots_held == 0


async def test_close_ends_everything() -> None:
    b, _, _, _ = make(max_num_seqs=1)
    reqs: list[GenerationRequest] = [b.submit(s, 1, 60) for s in ("a", "b")]  # type: ignore[arg-type]
    await settle()
    b.close()
    for req in reqs:
        with pytest.raises(Exception, match="unloading"):
            await req.collect()


# --- the channel --------------------------------------------------------------------------


async def test_channel_merges_what_is_buffered_and_is_bounded() -> None:
    resumed = []
    ch = TokenChannel(3, on_resume=lambda: resumed.append(1))
    outs = [
        StepOutput("r", i, t, i == 3, "stop" if i == 3 else None, 2, i + 1)
        for i, t in enumerate("abcd")
    ]
    for o in outs[:3]:
        ch.push(o)
    assert ch.full and ch.backlog == 3
    ch.paused = True
    first = await anext(ch)
    assert (first.text, first.token_ids, first.completion_tokens) == ("abc", [0, 1, 2], 3)
    assert resumed == [1] and not ch.paused
    reader = asyncio.ensure_future(anext(ch))
    await asyncio.sleep(0)
    assert not reader.done()  # waits for the next output
    ch.push(outs[3])
    last = await reader
    assert last.finished and last.finish_reason == "stop" and last.text == "d"
    with pytest.raises(StopAsyncIteration):
        await anext(ch)
    ch.push(outs[0])  # nothing is accepted after the last output
    assert ch.backlog == 0


async def test_a_member_that_fails_alone_ends_alone() -> None:
    b, ex, _, stats = make()
    bad = b.submit("bad", 1, 60)  # type: ignore[arg-type]
    good = b.submit("good", 1, 60)  # type: ignore[arg-type]
    await settle()
    job = ex.jobs[-1]
    job.outputs = [
        StepOutput("bad", -1, "", True, None, 1, 0, error="IndexError: no", error_code="internal"),
        StepOutput("good", 7, "<good>", True, "length", 1, 1),
    ]
    job.on_done(job)
    with pytest.raises(InternalError, match="IndexError: no"):
        await bad.collect()
    text, _ = await good.collect()
    assert text == "<good>" and b.idle and b.slots_held == 0
    assert stats.success.count == 1 and stats.fail.count == 1


async def test_waiting_sequences_wait_for_an_engine_that_is_being_replaced() -> None:
    b, ex, clock, stats = make(max_num_seqs=1)
    running = b.submit("run", 1, 60)  # type: ignore[arg-type]
    await settle()
    short = b.submit("short", 1, 5)  # type: ignore[arg-type]
    patient = b.submit("patient", 1, 60)  # type: ignore[arg-type]
    ex.live = 0  # the step process died with "run" in it
    b.fail_running(RuntimeError("the step process exited"))
    ex.answer(error=RuntimeError("the step process exited"))  # the step in flight fails
    late = b.submit("late", 1, 60)  # type: ignore[arg-type]  # arrivals queue too
    await settle()
    assert len(ex.jobs) == 1 and (b.waiting, b.running) == (3, 0)
    with pytest.raises(InternalError, match="exited"):
        await running.collect()
    clock.now += 6  # "short" runs out of time while the engine is away
    b._on_timer()
    await settle()
    with pytest.raises(DeadlineExceeded, match="restarting"):
        await short.collect()
    ex.live = 1
    b.resume()
    await settle()
    assert ex.jobs[-1].new == ["patient"]
    ex.answer(finished={"patient"})
    assert ex.jobs[-1].new == ["late"]
    ex.answer(finished={"late"})
    assert [(await r.collect())[0] for r in (patient, late)] == ["<patient>", "<late>"]
    assert b.idle and b.slots_held == 0 and stats.timed_out == 1


async def test_a_step_that_never_reached_the_engine_requeues_its_new_sequences() -> None:
    b, ex, _, _ = make()
    a = b.submit("a", 1, 60)  # type: ignore[arg-type]
    await settle()
    job = ex.jobs[-1]
    job.error, job.not_run = RuntimeError("the step process is gone"), True
    ex.live = 0
    job.on_done(job)
    assert (b.waiting, b.running, b.slots_held) == (1, 0, 0)
    ex.live = 1
    b.resume()
    await settle()
    assert ex.jobs[-1].new == ["a"]
    ex.answer(finished={"a"})
    assert (await a.collect())[0] == "<a>"


async def test_a_burst_that_slots_and_queue_can_take_is_taken() -> None:
    b, ex, _, stats = make(max_num_seqs=2, max_queue_size=2)
    burst = [b.submit(str(i), 1, 60) for i in range(4)]  # type: ignore[arg-type]
    with pytest.raises(QueueFull):  # 2 for the free slots + 2 queued, then full
        b.submit("5", 1, 60)  # type: ignore[arg-type]
    await settle()
    assert ex.jobs[-1].new == ["0", "1"] and b.waiting == 2
    with pytest.raises(QueueFull):  # the slots are taken now: the queue alone counts
        b.submit("6", 1, 60)  # type: ignore[arg-type]
    ex.answer(finished={"0", "1"})
    ex.answer(finished={"2", "3"})
    assert [(await r.collect())[0] for r in burst] == ["<0>", "<1>", "<2>", "<3>"]
    assert stats.rejected["queue_full"] == 2


# --- priorities (vLLM's: lower first) ------------------------------------------------------


async def test_admission_goes_by_priority_then_deadline() -> None:
    b, ex, _, _ = make(max_num_seqs=1)
    b.submit("hold", 1, 60)  # type: ignore[arg-type]
    await settle()
    for seq, timeout, priority in (
        ("p5-early", 10, 5), ("p0-late", 60, 0), ("p0-early", 30, 0), ("p5-late", 50, 5),
        ("neg", 90, -1),
    ):  # fmt: skip
        b.submit(seq, 1, timeout, priority=priority)  # type: ignore[arg-type]
    # Most urgent first, and so are the keys.
    by_priority = b.statistics()["waiting_by_priority"]
    assert by_priority == {"-1": 1, "0": 2, "5": 2} and list(by_priority) == ["-1", "0", "5"]
    admitted = []
    for _ in range(5):
        ex.answer(finished={*ex.jobs[-1].new, *ex.jobs[-1].running})
        admitted += ex.jobs[-1].new
    assert admitted == ["neg", "p0-early", "p0-late", "p5-early", "p5-late"]
    assert b.statistics()["waiting_by_priority"] == {}


async def test_a_more_urgent_arrival_takes_the_place_of_the_least_urgent_waiting_one() -> None:
    b, ex, clock, stats = make(max_num_seqs=1, max_queue_size=2)
    b.submit("hold", 1, 60)  # type: ignore[arg-type]
    await settle()
    first = b.submit("first", 1, 60, priority=5)  # type: ignore[arg-type]
    second = b.submit("second", 1, 60, priority=5)  # type: ignore[arg-type]
    # Full. One of priority 0 pushes out the one that would go last: of the
    # least urgent priority, the latest deadline (here the later arrival).
    urgent = b.submit("urgent", 1, 60, priority=0)  # type: ignore[arg-type]
    with pytest.raises(QueueFull, match=r"more urgent request \(priority 0\).*priority 5"):
        await second.collect()
    assert b.statistics()["waiting_by_priority"] == {"0": 1, "5": 1}
    # One of the same priority as the least urgent one is refused at once, as
    # with no priorities, and so is a less urgent one; the queue is unchanged.
    for priority in (5, 7):
        with pytest.raises(
            QueueFull, match=f"none less urgent than this one's priority {priority}"
        ):
            b.submit("late", 1, 60, priority=priority)  # type: ignore[arg-type]
    # An urgent one whose deadline has passed already pushes nobody out.
    with pytest.raises(DeadlineExceeded):
        b.submit("spent", 1, 1, arrival=clock.now - 5, priority=-3)  # type: ignore[arg-type]
    assert b.statistics()["waiting_by_priority"] == {"0": 1, "5": 1}
    again = b.submit("again", 1, 60, priority=0)  # type: ignore[arg-type]
    with pytest.raises(QueueFull, match="took the place of this one"):
        await first.collect()
    # A queue of priority 0 alone: priority 0 is refused, -1 would find room.
    with pytest.raises(QueueFull, match="max_queue_size 2"):
        b.check_room(priority=0)
    b.check_room(priority=-1)
    assert b.statistics()["waiting_by_priority"] == {"0": 2}
    # Two displaced, three refused (the one check_room refused among them).
    assert stats.rejected["queue_full"] == 5 and stats.fail.count == 2
    ex.answer(finished={"hold"})
    assert ex.jobs[-1].new == ["urgent"]
    ex.answer(finished={"urgent"})
    assert ex.jobs[-1].new == ["again"]
    ex.answer(finished={"again"})
    assert [(await r.collect())[0] for r in (urgent, again)] == ["<urgent>", "<again>"]
    assert b.idle and b.slots_held == 0


async def test_waiting_ones_expire_from_every_priority_and_the_timer_counts_each() -> None:
    b, ex, clock, stats = make(max_num_seqs=1, stream_buffer_chunks=1)
    hold = b.submit("hold", 1, 60)  # type: ignore[arg-type]
    await settle()
    urgent = b.submit("urgent", 1, 60, priority=0)  # type: ignore[arg-type]
    short = b.submit("short", 1, 5, priority=9)  # type: ignore[arg-type]
    ex.answer()  # hold's reader is a step behind: it is paused, keeping the slot
    assert len(ex.jobs) == 1 and hold.channel.paused and b._timer is not None
    # The batcher sleeps until the least urgent one's deadline, the earliest.
    loop = asyncio.get_running_loop()
    assert b._timer.when() - loop.time() <= 5
    clock.now += 5
    b._on_timer()
    await settle()
    with pytest.raises(DeadlineExceeded, match="waiting for a slot"):
        await short.collect()
    assert stats.timed_out == 1 and b.statistics()["waiting_by_priority"] == {"0": 1}
    assert urgent.channel.backlog == 0 and b.waiting == 1


# --- an executor that runs ahead (as the step process does) ---------------------------------


class AheadExecutor(FakeExecutor):
    """A FakeExecutor that, once a step is answered, goes on with its sequences
    unasked: the test plays those steps with :meth:`ahead`."""

    run_ahead = 4

    def __init__(self) -> None:
        super().__init__()
        self.coasting: list[Any] = []

    def answer(self, finished: set[Any] = frozenset(), error: Exception | None = None) -> StepJob:
        job = super().answer(finished, error)
        members = [*job.new, *job.running]
        self.coasting = [] if error else [s for s in members if s not in finished]
        return job

    def ahead(self, finished: set[Any] = frozenset()) -> None:
        """One step the executor ran on its own, as the step process answers it."""
        seqs = list(self.coasting)
        job = StepJob([], seqs, [], self.jobs[-1].on_done)
        job.stepped = seqs
        job.outputs = [
            StepOutput(
                str(s), 7, f"<{s}>", s in finished, "length" if s in finished else None, 3, 1
            )
            for s in seqs
        ]
        self.coasting = [s for s in seqs if s not in finished]
        job.on_done(job)


def make_ahead(**generation: Any) -> tuple[ContinuousBatcher, AheadExecutor, ModelStats]:
    executor, stats = AheadExecutor(), ModelStats("m", "1")
    config = GenerationConfig(**{"max_num_seqs": 2, "max_prefill_tokens": 100, **generation})
    return ContinuousBatcher("m/1", config, executor, stats, Clock()), executor, stats


async def test_steps_run_ahead_are_taken_without_a_new_step() -> None:
    b, ex, stats = make_ahead()
    a = b.submit("a", 10, 60)  # type: ignore[arg-type]
    c = b.submit("c", 10, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()
    ex.ahead()
    ex.ahead(finished={"c"})  # c's slot is freed by the engine: nothing to tell it
    assert len(ex.jobs) == 1 and b.slots_held == 1 and b.ahead_steps == 2
    ex.ahead(finished={"a"})
    assert len(ex.jobs) == 1 and b.idle and b.slots_held == 0
    assert (await a.collect())[0] == "<a>" * 4 and (await c.collect())[0] == "<c>" * 3
    assert stats.success.count == 2 and b.statistics()["ahead_step_count"] == 3
    # An arrival with nothing running is a step of its own again.
    b.submit("d", 10, 60)  # type: ignore[arg-type]
    await settle()
    assert len(ex.jobs) == 2 and ex.jobs[-1].new == ["d"]


async def test_a_cancel_while_running_ahead_frees_the_slot_and_drops_late_tokens() -> None:
    b, ex, stats = make_ahead()
    a = b.submit("a", 10, 60)  # type: ignore[arg-type]
    x = b.submit("x", 10, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()
    ex.ahead()
    assert await anext(x) is not None
    x.cancel()
    await settle()
    # The next step the batcher sends frees x's slot; the rest goes on.
    assert ex.jobs[-1].free == ["x"] and ex.jobs[-1].running == ["a"] and b.slots_held == 1
    ex.ahead()  # run before the step above reached it: x's token is dropped
    assert stats.cancelled == 1 and x.channel.backlog == 0
    ex.answer()
    ex.ahead(finished={"a"})
    assert len(ex.jobs) == 2 and b.idle and b.slots_held == 0
    assert (await a.collect())[0] == "<a>" * 5


async def test_a_reader_that_falls_behind_stops_the_running_ahead_for_it() -> None:
    b, ex, _ = make_ahead(stream_buffer_chunks=2)
    slow = b.submit("slow", 1, 60)  # type: ignore[arg-type]
    fast = b.submit("fast", 1, 60)  # type: ignore[arg-type]
    await settle()
    ex.answer()
    await anext(fast)
    ex.ahead()
    await anext(fast)
    # slow has 2 unread outputs: a step leaves it out.
    assert len(ex.jobs) == 2 and ex.jobs[-1].running == ["fast"] and slow.channel.paused
    ex.ahead()  # ran before that step arrived: kept, not lost
    await anext(fast)
    assert slow.channel.backlog == 3
    ex.answer()
    await anext(fast)
    ex.ahead()
    await anext(fast)
    assert len(ex.jobs) == 2  # fast alone goes on unasked
    delta = await anext(slow)  # reading resumes it: a step brings it back
    assert delta.text == "<slow>" * 3
    await settle()
    assert ex.jobs[-1].running == ["fast", "slow"] or ex.jobs[-1].running == ["slow", "fast"]
