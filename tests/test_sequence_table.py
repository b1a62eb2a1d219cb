"""The pure parts of sequence batching, with plain numbers for the clock: the slot
table (sched/sequences.py), ``direct``'s rows (sched/direct.py), the request
parameters (codecs/sequence.py) and the config's checks; and the loop's driver
(loop/sequences.py) with a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from aserve.codecs.sequence import SequenceParams, refuse_sequence, sequence_params
from aserve.config import ModelConfig
from aserve.errors import InvalidArgument, QueueFull, Unavailable, Unimplemented
from aserve.loop.sequences import Sequences
from aserve.sched.direct import RowLayout, layout, place
from aserve.sched.sequences import ENDED, IDLE, SequenceTable

pytestmark = pytest.mark.timeout(30)


def test_slots_are_taken_lowest_first_and_freed_at_the_end() -> None:
    t = SequenceTable("m/1", slots=2, idle_s=1.0)
    a, b, c = t.start(1), t.start("b"), t.start(3)
    assert t.take_slot(a) and t.take_slot(b)
    assert (a.slot, b.slot) == (0, 1)
    assert not t.take_slot(c)  # every slot held
    assert t.active == 3
    assert t.close(a, ENDED)
    assert t.take_slot(c) and c.slot == 0
    assert not t.close(a, ENDED)  # once only


def test_the_table_knows_who_holds_each_slot() -> None:
    t = SequenceTable("m/1", slots=2, idle_s=1.0)
    a, b = t.start(1), t.start(2)
    assert t.take_slot(a) and t.take_slot(b)
    assert t.holders == {0: a, 1: b}
    t.close(a, ENDED)
    assert t.holders == {1: b}
    t.expire(10.0)  # b idle since 0.0
    assert t.holders == {}


def test_direct_places_a_slot_on_an_instance_and_row() -> None:
    assert [place(s, 4) for s in (0, 3, 4, 9)] == [(0, 0), (0, 3), (1, 0), (2, 1)]


def test_direct_layout_puts_requests_at_their_rows_and_pads_between() -> None:
    assert layout([2], 4) == RowLayout(3, (2,), (0, 1))
    assert layout([3, 1], 4) == RowLayout(4, (3, 1), (0, 2))
    assert layout([0, 1, 2, 3], 4) == RowLayout(4, (0, 1, 2, 3), ())
    assert layout([5, 4], 4) == RowLayout(2, (1, 0), ())  # instance 1's rows


@pytest.mark.parametrize(
    ("slots", "says"),
    [([], "at least one"), ([1, 1], "share a row"), ([0, 4], "not all of instance 0")],
)
def test_direct_layout_refuses_what_dispatch_never_forms(slots: list[int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        layout(slots, 4)


def test_second_start_unknown_and_ended_are_refused_saying_which() -> None:
    t = SequenceTable("m/1", slots=1, idle_s=1.0)
    seq = t.start(7)
    with pytest.raises(InvalidArgument, match="already started and has not ended"):
        t.start(7)
    with pytest.raises(InvalidArgument, match="sequence 8 of model 'm/1' is unknown"):
        t.find(8)
    seq.state["x"] = 1
    t.close(seq, ENDED)
    assert seq.state == {}  # freed with it
    with pytest.raises(InvalidArgument, match="has ended"):
        t.find(7)
    assert t.start(7) is not seq  # a new sequence of the same id


def test_idle_sequences_expire_only_when_no_request_uses_them() -> None:
    t = SequenceTable("m/1", slots=2, idle_s=0.5)
    a, b = t.start(1), t.start(2)
    t.take_slot(a), t.take_slot(b)
    t.enter(a)
    t.enter(b)
    t.leave(a, now=10.0)
    assert t.next_expiry() == 10.5  # b is in use: not idle
    assert t.expire(10.4) == []
    assert t.expire(10.5) == [a]
    with pytest.raises(InvalidArgument, match="freed after being idle"):
        t.find(1)
    assert t.free_slots == 1
    assert t.next_expiry() is None
    t.leave(b, now=11.0)
    assert t.expire(11.2) == [] and t.next_expiry() == 11.5
    assert t.expire(11.5) == [b] and b.closed == IDLE


@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({"sequence_id": 5, "sequence_start": True}, SequenceParams(5, True, False)),
        ({"sequence_id": "s", "sequence_end": True}, SequenceParams("s", False, True)),
        (
            {"sequence_id": 2**64 - 1, "sequence_start": None},
            SequenceParams(2**64 - 1, False, False),
        ),
    ],
)
def test_parameters_read(params: dict[str, Any], want: SequenceParams) -> None:
    assert sequence_params(params, "m/1") == want


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (None, "needs the parameter 'sequence_id'"),
        ({"sequence_id": 0}, "needs the parameter 'sequence_id'"),
        ({"sequence_id": ""}, "needs the parameter 'sequence_id'"),
        ({"sequence_id": 2.0}, "positive integer or a non-empty string"),
        ({"sequence_id": -1}, "between 1 and 2**64 - 1"),
        ({"sequence_id": 1, "sequence_end": 1}, "'sequence_end' must be true or false"),
    ],
)
def test_bad_parameters(params: Any, says: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        sequence_params(params, "m/1")
    assert says in exc.value.message


def test_a_model_without_sequences_refuses_an_id_only() -> None:
    refuse_sequence(None, "m/1")
    refuse_sequence({"sequence_id": 0, "priority": 1}, "m/1")
    with pytest.raises(Unimplemented, match="does not serve sequences"):
        refuse_sequence({"sequence_id": "a"}, "m/1")


def _model(**sb: Any) -> dict[str, Any]:
    return {
        "name": "m", "engine": "torch", "path": "m.pt",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]},
                   {"name": "S", "datatype": "INT32", "shape": [1]},
                   {"name": "ID", "datatype": "UINT64", "shape": [1]},
                   {"name": "ST", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]},
                    {"name": "STO", "datatype": "FP32", "shape": [4]}],
        "sequence_batching": sb,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("sb", "says"),
    [
        ({"control_inputs": {"start": "NOPE"}}, "'NOPE' is not among the model's inputs"),
        ({"control_inputs": {"start": "S", "end": "S"}}, "already the start control"),
        ({"control_inputs": {"corrid": "S"}}, "a corrid control is one of UINT64, INT64, BYTES"),
        ({"control_inputs": {"ready": "ST"}}, "has shape [4]; a control has [1]"),
        ({"state": [{"input": "ST", "output": "Y"}]}, "must have the same datatype and shape"),
        ({"state": [{"input": "ST", "output": "NO"}]}, "state[0].output: 'NO' is not among"),
        ({"strategy": "direct", "max_candidate_sequences": 4}, "only for strategy 'oldest'"),
        ({"max_sequence_idle_microseconds": 0}, "greater than or equal to 1"),
        ({"control_inputs": {"start": "S", "ready": "X", "corrid": "ID"},
          "state": [{"input": "ST", "output": "STO"}]}, "every input is a control or a state"),
    ],
)  # fmt: skip
def test_config_checks(sb: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as exc:
        ModelConfig.model_validate(_model(**sb))
    assert says in str(exc.value)


def test_config_refuses_on_demand_and_pipelines() -> None:
    with pytest.raises(ValidationError, match="not with load 'on_demand' yet"):
        ModelConfig.model_validate({**_model(), "load": "on_demand"})


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sequences(clock: FakeClock, **sb: Any) -> Sequences:
    config = ModelConfig.model_validate(
        {**_model(control_inputs={"start": "S", "corrid": "ID"},
                  state=[{"input": "ST", "output": "STO", "initial_value": 2}], **sb),
         "batching": {"max_batch_size": 1, "max_queue_size": 1}}
    )  # fmt: skip
    return Sequences("m/1", config, clock)


def test_turns_run_in_order_and_fill_controls_and_state() -> None:
    import numpy as np

    async def run() -> None:
        clock = FakeClock()
        seqs = _sequences(clock)
        far = clock.now + 60
        order: list[str] = []
        async with seqs.turn({"sequence_id": 9, "sequence_start": True}, 1, far) as t:
            filled = t.fill({"X": np.ones((1, 1), np.float32)})
            assert filled["S"].tolist() == [[1]] and filled["ID"].tolist() == [[9]]
            assert filled["ST"].tolist() == [[2.0] * 4]
            answer = t.keep({"Y": np.zeros((1, 1)), "STO": np.full((1, 4), 7.0)})
            assert list(answer) == ["Y"]  # the state output is kept, not answered

            async def second() -> None:
                async with seqs.turn({"sequence_id": 9}, 1, far) as t2:
                    order.append("second")
                    f2 = t2.fill({"X": np.ones((1, 1), np.float32)})
                    assert f2["S"].tolist() == [[0]]
                    assert f2["ST"].tolist() == [[7.0] * 4]  # the state kept

            task = asyncio.ensure_future(second())
            await asyncio.sleep(0)  # it waits for this turn, whatever the loop does
            await asyncio.sleep(0)
            assert not order
            order.append("first")
        await task
        assert order == ["first", "second"]
        # A string id for a UINT64 CORRID is refused before anything is held.
        with pytest.raises(InvalidArgument, match="takes integer sequence ids"):
            async with seqs.turn({"sequence_id": "x", "sequence_start": True}, 1, far):
                pass
        assert seqs.active == 1

    asyncio.run(run())


def test_a_start_with_no_slot_waits_is_refused_at_its_deadline_or_when_too_many_wait() -> None:
    async def run() -> None:
        clock = FakeClock()
        seqs = _sequences(clock)  # one slot, one start may wait
        async with seqs.turn({"sequence_id": 1, "sequence_start": True}, 1, clock.now + 60):
            pass
        with pytest.raises(Unavailable, match="no sequence slot came free"):
            async with seqs.turn({"sequence_id": 2, "sequence_start": True}, 1, clock.now):
                pass
        assert seqs.active == 1  # the refused start left nothing behind
        waiting = asyncio.ensure_future(_one(seqs, 3, clock.now + 60))
        for _ in range(10):  # turns of the loop until it waits for the slot, not time
            if seqs.active == 2:
                break
            await asyncio.sleep(0)
        assert seqs.active == 2
        with pytest.raises(QueueFull):
            await _one(seqs, 4, clock.now + 60)
        await _one(seqs, 1, clock.now + 60, start=False, end=True)  # frees the slot
        assert await waiting == 0

    asyncio.run(run())


async def _one(seqs: Sequences, seq_id: int, deadline: float, start: bool = True,
               end: bool = False) -> int:  # fmt: skip
    params = {"sequence_id": seq_id, "sequence_start": start, "sequence_end": end}
    async with seqs.turn(params, 1, deadline) as t:
        return t.info.slot
