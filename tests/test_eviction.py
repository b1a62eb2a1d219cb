"""The pure eviction choice, request rates and load estimates of
``aserve.sched.eviction``, on a fake clock (every time below is a number the
test chooses)."""

from __future__ import annotations

import math

import pytest

from aserve.sched.eviction import (
    FOOTPRINT_OVERHEAD_MIB,
    FOOTPRINT_RATIO,
    HALF_LIFE_S,
    LOAD_FIXED_S,
    LOAD_READ_MIB_PER_S,
    MIB,
    Held,
    Queued,
    RequestRate,
    estimate_footprint_mib,
    estimate_load_s,
    make_room,
    ready_at,
    worth_waiting,
)


def _held(
    label: str,
    mib: float,
    used: float,
    resident: bool = False,
    busy: bool = False,
    rate: float = 0.0,
    load_s: float = 0.1,
) -> Held:
    return Held(label, mib, used, resident=resident, busy=busy, rate_per_s=rate, load_s=load_s)


def _rate(times: list[float]) -> RequestRate:
    rate = RequestRate()
    for t in times:
        rate.note(t)
    return rate


# --- request rates ------------------------------------------------------------------


def test_a_request_counts_half_after_the_half_life():
    rate = _rate([100.0])
    assert rate.count(100.0) == 1.0
    assert rate.count(100.0 + HALF_LIFE_S) == pytest.approx(0.5)
    assert rate.count(100.0 + 2 * HALF_LIFE_S) == pytest.approx(0.25)
    rate.note(100.0 + HALF_LIFE_S)
    assert rate.count(100.0 + HALF_LIFE_S) == pytest.approx(1.5)
    assert RequestRate().count(5.0) == 0.0 and RequestRate().per_s(5.0) == 0.0


def test_a_steady_stream_reads_as_its_rate():
    # 4 requests a second for ten half-lives: the decayed count's rate is 4/s.
    rate = _rate([i / 4 for i in range(int(10 * HALF_LIFE_S * 4))])
    assert rate.per_s(10 * HALF_LIFE_S) == pytest.approx(4.0, rel=0.01)
    # Gone quiet, it falls by half each half-life.
    assert rate.per_s(11 * HALF_LIFE_S) == pytest.approx(2.0, rel=0.01)


def test_time_alone_never_reorders_two_rates():
    hot, cold = _rate([0.0, 1.0, 2.0, 3.0]), _rate([50.0])
    for now in (50.0, 80.0, 500.0, 5000.0):
        assert hot.per_s(now) > cold.per_s(now)
    assert hot.per_s(80.0) / cold.per_s(80.0) == pytest.approx(hot.count(50.0) / 1.0)


def test_a_rate_follows_its_half_life():
    rate = RequestRate(half_life_s=10.0)
    rate.note(0.0)
    assert rate.count(10.0) == pytest.approx(0.5)
    assert rate.per_s(0.0) == pytest.approx(math.log(2) / 10.0)


# --- what makes room -----------------------------------------------------------------


def test_a_load_that_fits_evicts_nothing():
    room = make_room([_held("a", 40, 1.0), _held("b", 40, 2.0)], 20, 100)
    assert room.fits and room.evict == () and room.free_mib == 20


def test_exactly_the_budget_fits():
    assert make_room([_held("a", 60, 1.0)], 40, 100).evict == ()


def test_lru_takes_the_least_recently_used_first_and_no_more_than_needed():
    # The rates say the opposite: lru does not read them.
    held = [
        _held("new", 30, 9.0, rate=0.1), _held("old", 30, 1.0, rate=9.0),
        _held("mid", 30, 5.0, rate=5.0),
    ]  # fmt: skip
    room = make_room(held, 30, 100, "lru")  # 10 free: one 30 MiB model must go
    assert room.fits and room.evict == ("old",) and room.free_mib == 40
    room = make_room(held, 60, 100, "lru")  # 10 free: two must go, oldest first
    assert room.fits and room.evict == ("old", "mid")


def test_cost_takes_the_cheapest_to_evict_first():
    # rate x load time: new 0.01 s/s, mid 0.5, old 0.9.
    held = [
        _held("new", 30, 9.0, rate=0.1), _held("old", 30, 1.0, rate=9.0),
        _held("mid", 30, 5.0, rate=5.0),
    ]  # fmt: skip
    room = make_room(held, 30, 100, "cost")
    assert room.fits and room.evict == ("new",) and room.free_mib == 40
    assert make_room(held, 60, 100, "cost").evict == ("new", "mid")
    assert make_room(held, 30, 100).evict == ("new",)  # the default


def test_cost_weighs_the_load_time():
    # The same rate; the one that loads in 10 ms costs less to evict than 1 s.
    held = [_held("slow", 30, 1.0, rate=2.0, load_s=1.0), _held("fast", 30, 9.0, rate=2.0,
            load_s=0.01)]  # fmt: skip
    assert make_room(held, 60, 100, "cost").evict == ("fast",)
    assert make_room(held, 60, 100, "lru").evict == ("slow",)


def test_equal_costs_go_least_recently_used_first():
    held = [
        _held("b", 30, 5.0, rate=1.0, load_s=0.2), _held("a", 30, 2.0, rate=2.0, load_s=0.1),
        _held("c", 30, 8.0, rate=0.5, load_s=0.4),
    ]  # fmt: skip
    assert make_room(held, 30, 100, "cost").evict == ("a",)
    assert make_room(held, 60, 100, "cost").evict == ("a", "b")


def test_the_hot_model_stays_where_lru_would_evict_it():
    """The hot one was used before the cold one; lru takes it, cost keeps it."""
    now = 120.0
    hot = _rate([i / 5 for i in range(500)])  # 5 requests a second until t=100
    cold = _rate([110.0])  # one request since
    held = [
        _held("hot", 30, 100.0, rate=hot.per_s(now), load_s=0.05),
        _held("cold", 30, 110.0, rate=cold.per_s(now), load_s=0.05),
    ]  # fmt: skip
    assert make_room(held, 60, 100, "cost").evict == ("cold",)
    assert make_room(held, 60, 100, "lru").evict == ("hot",)


def test_a_burst_of_cold_models_never_evicts_the_hot_one():
    """A device of 100 MiB holds the hot model (40) and room for two more of 30.
    Twenty cold models come one request each, one after the other, each loaded
    in turn: each one's load evicts an earlier cold one, never the hot one, which
    keeps being asked for between them."""
    budget, now = 100.0, 0.0
    rates = {"hot": RequestRate()}
    last: dict[str, float] = {}
    mib = {"hot": 40.0}
    loaded = {"hot"}
    for i in range(300):  # its history: 10 requests a second for 30 s
        now = i / 10
        rates["hot"].note(now)
        last["hot"] = now
    for k in range(20):
        now += 0.5
        name = f"cold{k}"
        rates[name], mib[name] = RequestRate(), 30.0
        rates[name].note(now)
        held = [_held(n, mib[n], last[n], rate=rates[n].per_s(now), load_s=0.05) for n in loaded]
        room = make_room(held, mib[name], budget, "cost")
        assert room.fits and "hot" not in room.evict
        loaded -= set(room.evict)
        loaded.add(name)
        last[name] = now
        rates["hot"].note(now + 0.25)  # the hot model's requests go on meanwhile
        last["hot"] = now + 0.25
    assert "hot" in loaded and len(loaded) == 3
    # lru, with the same history, evicts it as soon as two cold ones came after it.
    held = [_held("hot", 40, 10.0), _held("cold0", 30, 11.0), _held("cold1", 30, 12.0)]
    assert make_room(held, 30, 100, "lru").evict == ("hot",)


def test_no_more_leave_than_needed():
    # Cheapest first: small (10 MiB) then big (50): big alone makes the room.
    held = [_held("small", 10, 1.0, rate=0.01), _held("big", 50, 2.0, rate=0.1),
            _held("hot", 35, 3.0, rate=5.0)]  # fmt: skip
    room = make_room(held, 45, 100, "cost")  # 5 free: 45 needed
    assert room.fits and room.evict == ("big",) and room.free_mib == 55
    # When both are needed, both leave, cheapest first.
    room = make_room(held, 60, 100, "cost")
    assert room.fits and room.evict == ("small", "big") and room.free_mib == 65


@pytest.mark.parametrize("policy", ["cost", "lru"])
def test_resident_and_busy_models_are_never_chosen(policy: str):
    # The pinned and working ones are the cheapest and the least recently used.
    held = [
        _held("pinned", 30, 1.0, resident=True, rate=0.0),
        _held("working", 30, 2.0, busy=True, rate=0.0),
        _held("idle", 30, 3.0, rate=50.0),
    ]
    room = make_room(held, 30, 100, policy)  # type: ignore[arg-type]
    assert room.fits and room.evict == ("idle",)
    room = make_room(held, 80, 100, policy)  # type: ignore[arg-type]
    assert not room.fits and room.evict == ("idle",)


def test_no_room_when_what_may_leave_is_not_enough():
    held = [_held("pinned", 50, 1.0, resident=True), _held("idle", 30, 2.0)]
    room = make_room(held, 60, 100)  # 20 free, 50 at most once idle leaves
    assert not room.fits
    assert room.evict == ("idle",) and room.free_mib == 50


def test_a_load_larger_than_the_budget_never_fits():
    room = make_room([], 120, 100)
    assert not room.fits and room.evict == ()


def test_after_a_load_room_for_nothing_more_brings_it_back_under_the_budget():
    # A footprint measured above the estimate: the device holds 110 of 100.
    held = [_held("a", 40, 1.0), _held("loaded", 70, 9.0, busy=True)]
    room = make_room(held, 0.0, 100)
    assert room.fits and room.evict == ("a",)


# --- waiting for a busy model that is cheaper to evict -----------------------------


def _device_after_a_one_off_load() -> list[Held]:
    """hot (30 MiB, 5 requests a second) idle; cold (30, one request) still answering
    the request it was loaded for; 40 MiB held by a resident one."""
    return [
        _held("hot", 30, 1.0, rate=5.0, load_s=0.05),
        _held("cold", 30, 2.0, busy=True, rate=0.02, load_s=0.05),
        _held("pinned", 40, 0.0, resident=True),
    ]


def test_a_busy_model_cheaper_to_evict_is_worth_waiting_for():
    held = _device_after_a_one_off_load()
    assert make_room(held, 30, 100).evict == ("hot",)  # the idle choice: the hot one
    assert worth_waiting(held, 30, 100, {"hot", "cold"}) == ("cold",)


def test_waiting_is_for_busy_models_that_the_caller_names():
    held = _device_after_a_one_off_load()
    assert worth_waiting(held, 30, 100, {"hot"}) == ()  # e.g. the load's own runtime


def test_no_wait_when_the_busy_one_costs_more_or_nothing_must_leave():
    held = [
        _held("idle", 30, 1.0, rate=0.1, load_s=0.05),
        _held("busy", 30, 2.0, busy=True, rate=5.0, load_s=0.05),
    ]  # fmt: skip
    assert worth_waiting(held, 60, 100, {"idle", "busy"}) == ()
    assert worth_waiting(held, 40, 100, {"idle", "busy"}) == ()  # 40 free: it fits


def test_a_wait_that_makes_room_where_the_idle_ones_cannot():
    held = [_held("busy", 50, 2.0, busy=True, rate=1.0), _held("idle", 30, 1.0, rate=0.1)]
    assert not make_room(held, 60, 100).fits
    assert worth_waiting(held, 60, 100, {"busy", "idle"}) == ("busy",)
    # A resident one is never waited for: it would not leave once idle.
    held = [_held("pinned", 50, 2.0, busy=True, resident=True), _held("idle", 30, 1.0)]
    assert worth_waiting(held, 60, 100, {"pinned", "idle"}) == ()


# --- estimates and the loads' queue ---------------------------------------------------


def test_the_estimates_grow_with_the_files():
    assert estimate_footprint_mib(0) == FOOTPRINT_OVERHEAD_MIB
    assert estimate_footprint_mib(64 * MIB) == pytest.approx(
        64 * FOOTPRINT_RATIO + FOOTPRINT_OVERHEAD_MIB
    )
    assert estimate_footprint_mib(64 * MIB) > 64  # above what the weights need
    assert estimate_load_s(0) == LOAD_FIXED_S
    assert estimate_load_s(200 * MIB) == pytest.approx(LOAD_FIXED_S + 200 / LOAD_READ_MIB_PER_S)


def test_one_load_at_a_time_waits_for_those_ahead():
    queue = [Queued(2.0, started_at=10.0), Queued(1.0), Queued(3.0)]
    assert ready_at(queue, 0, 11.0, one_at_a_time=True) == 12.0
    assert ready_at(queue, 1, 11.0, one_at_a_time=True) == 13.0
    assert ready_at(queue, 2, 11.0, one_at_a_time=True) == 16.0


def test_a_load_running_past_its_estimate_is_taken_to_end_now():
    queue = [Queued(2.0, started_at=10.0), Queued(1.0)]
    assert ready_at(queue, 0, 15.0, one_at_a_time=True) == 15.0
    assert ready_at(queue, 1, 15.0, one_at_a_time=True) == 16.0


def test_without_a_budget_each_load_runs_on_its_own():
    queue = [Queued(2.0, started_at=10.0), Queued(1.0)]
    assert ready_at(queue, 0, 11.0, one_at_a_time=False) == 12.0
    assert ready_at(queue, 1, 11.0, one_at_a_time=False) == 12.0
