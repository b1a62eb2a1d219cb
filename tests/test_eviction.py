"""The pure eviction choice and load estimates of ``aserve.sched.eviction``."""

from __future__ import annotations

import pytest

from aserve.sched.eviction import (
    FOOTPRINT_OVERHEAD_MIB,
    FOOTPRINT_RATIO,
    LOAD_FIXED_S,
    LOAD_READ_MIB_PER_S,
    MIB,
    Held,
    Queued,
    estimate_footprint_mib,
    estimate_load_s,
    make_room,
    ready_at,
)


def _held(label: str, mib: float, used: float, resident: bool = False, busy: bool = False) -> Held:
    return Held(label, mib, used, resident=resident, busy=busy)


def test_a_load_that_fits_evicts_nothing():
    room = make_room([_held("a", 40, 1.0), _held("b", 40, 2.0)], 20, 100)
    assert room.fits and room.evict == () and room.free_mib == 20


def test_exactly_the_budget_fits():
    assert make_room([_held("a", 60, 1.0)], 40, 100).evict == ()


def test_least_recently_used_goes_first_and_no_more_than_needed():
    held = [_held("new", 30, 9.0), _held("old", 30, 1.0), _held("mid", 30, 5.0)]
    room = make_room(held, 30, 100)  # 10 free: one 30 MiB model must go
    assert room.fits and room.evict == ("old",) and room.free_mib == 40
    room = make_room(held, 60, 100)  # 10 free: two must go, oldest first
    assert room.fits and room.evict == ("old", "mid")


def test_resident_and_busy_models_are_never_chosen():
    held = [
        _held("pinned", 30, 1.0, resident=True),
        _held("working", 30, 2.0, busy=True),
        _held("idle", 30, 3.0),
    ]
    room = make_room(held, 30, 100)
    assert room.fits and room.evict == ("idle",)


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
