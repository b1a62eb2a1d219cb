"""Sequence batching on the loop: a stateful model's requests in their sequences.

Layer: ``loop``; runs on the event loop only. A model with
``sequence_batching`` has a :class:`Sequences` in front of its batcher (the
runtime that receives the request holds it: a handler's, so that its
``preprocess`` and ``postprocess`` run inside the sequence's turn, else the
batched runtime's). Each request passes :meth:`Sequences.turn`:

- its ``sequence_id``, ``sequence_start`` and ``sequence_end`` are read
  (:mod:`aserve.codecs.sequence`) and checked against the open sequences
  (:mod:`aserve.sched.sequences`, the decisions): unknown, ended, a second
  start are refused (400);
- a start takes a free slot, or waits for one until its deadline (then 503;
  with ``batching.max_queue_size`` starts waiting already, 429 at once);
- a sequence's requests run one at a time, in the order they came: the next
  waits for the previous one's answer (until its own deadline). So the
  batcher, which batches requests of different sequences as it batches any,
  never holds two of one sequence (under ``direct``, a model of tensors on
  instance threads has a batcher per instance and each request at its
  sequence's row: :mod:`aserve.loop.direct`);
- the control inputs and implicit states are filled in (:meth:`Turn.fill`),
  the state outputs kept and taken out of the answer (:meth:`Turn.keep`);
- a sequence with no request for ``max_sequence_idle_microseconds`` is
  closed by a timer, its slot and state freed.

The batcher's deadline rules are untouched: the time a request waits for its
turn or for a slot counts against its deadline like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from aserve.codecs.sequence import SequenceParams, sequence_params
from aserve.config import ModelConfig, SequenceBatchingConfig, TensorSpec
from aserve.errors import DeadlineExceeded, InvalidArgument, QueueFull, Unavailable
from aserve.sched.sequences import ENDED, START_REFUSED, Sequence, SequenceTable, describe
from aserve.types.sequence import SequenceInfo
from aserve.types.tensors import numpy_dtype

log = logging.getLogger("aserve.model")


def slot_count(config: ModelConfig) -> int:
    """The sequences a model serves at once: ``direct``, a slot per batch item
    of each instance; ``oldest``, ``max_candidate_sequences`` (by default the same)."""
    sb = config.sequence_batching
    assert sb is not None
    default = config.batching.max_batch_size * config.instances
    if sb.strategy == "oldest" and sb.max_candidate_sequences is not None:
        return sb.max_candidate_sequences
    return default


class Turn:
    """One request's turn in its sequence: what it fills in and keeps."""

    __slots__ = ("_owner", "_seq", "info")

    def __init__(self, owner: Sequences, seq: Sequence, info: SequenceInfo) -> None:
        self._owner = owner
        self._seq = seq
        self.info = info

    def fill(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``inputs`` with the control inputs and the implicit states added."""
        return self._owner.fill(inputs, self._seq, self.info)

    def keep(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` without the state outputs, which are kept for the next request."""
        return self._owner.keep(outputs, self._seq)


class Sequences:
    """The open sequences of one model version, their slots, turns and idle timer."""

    def __init__(
        self, label: str, config: ModelConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        sb = config.sequence_batching
        assert sb is not None
        self.label = label
        self.config: SequenceBatchingConfig = sb
        self.table = SequenceTable(
            label, slot_count(config), sb.max_sequence_idle_microseconds / 1e6
        )
        self._clock = clock
        self._max_waiting = config.batching.max_queue_size
        specs = {s.name: s for s in config.inputs}
        self._controls: list[tuple[str, str, TensorSpec]] = [
            (kind, name, specs[name]) for kind, name in sb.control_inputs.named()
        ]
        self._states: list[tuple[str, str, np.ndarray]] = []
        for st in sb.state:
            spec = specs[st.input]
            initial = np.full((1, *spec.shape), st.initial_value, dtype=numpy_dtype(spec.datatype))
            self._states.append((st.input, st.output, initial))
        corrid = next((s for k, _, s in self._controls if k == "corrid"), None)
        self._corrid_type = None if corrid is None else corrid.datatype
        # Starts waiting for a slot, first come first served: (sequence, future).
        self._backlog: deque[tuple[Sequence, asyncio.Future[None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def active(self) -> int:
        """Sequences started and not yet ended (the gauge)."""
        return self.table.active

    @property
    def hidden_outputs(self) -> set[str]:
        return {out for _, out, _ in self._states}

    # --- a request's turn ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def turn(
        self, parameters: dict[str, Any] | None, batch_size: int, deadline: float
    ) -> AsyncIterator[Turn]:
        """The request's turn in its sequence, once the requests before it are answered.

        Refusals raise before it is its turn (see the module docstring);
        cancelling the awaiting task gives up its place. Leaving the block
        hands the turn to the sequence's next request, and ends the sequence
        if the request had ``sequence_end`` (whether it succeeded or not).
        """
        p = sequence_params(parameters, self.label)
        self._check(p, batch_size)
        table = self.table
        if p.start:
            seq = table.start(p.id)
            seq.busy = True  # the start holds the turn while it waits for a slot
        else:
            seq = table.find(p.id)
        table.enter(seq)
        try:
            if p.start:
                try:
                    await self._slot(seq, deadline)
                except BaseException:
                    self._close(seq, START_REFUSED)
                    self._pass_turn(seq)
                    raise
            else:
                await self._wait_turn(seq, deadline)
            try:
                if seq.closed is not None:
                    raise InvalidArgument(
                        f"sequence {describe(seq.id)} of model '{self.label}' has {seq.closed}"
                    )
                assert seq.slot is not None
                yield Turn(self, seq, SequenceInfo(p.id, p.start, p.end, seq.slot, seq.state))
            finally:
                if p.end:
                    self._close(seq, ENDED)
                self._pass_turn(seq)
        finally:
            table.leave(seq, self._clock())
            self._arm_timer()

    def _check(self, p: SequenceParams, batch_size: int) -> None:
        if batch_size != 1:
            raise InvalidArgument(
                f"model '{self.label}' serves sequences: a request of a sequence carries one "
                f"item (batch dimension 1), got {batch_size}"
            )
        if self._closed:
            raise Unavailable(f"model '{self.label}' is unloading: its sequences are over")
        kind = self._corrid_type
        if kind is None or kind == "BYTES":
            return
        if isinstance(p.id, str):
            raise InvalidArgument(
                f"model '{self.label}' takes integer sequence ids (its CORRID control is "
                f"{kind}), got the string {p.id!r}"
            )
        if kind == "INT64" and p.id >= 2**63:
            raise InvalidArgument(
                f"model '{self.label}' takes sequence ids below 2**63 (its CORRID control is "
                f"INT64), got {p.id}"
            )

    async def _slot(self, seq: Sequence, deadline: float) -> None:
        """Take a free slot for ``seq``, or wait for one until ``deadline``."""
        if not self._backlog and self.table.take_slot(seq):
            return
        if len(self._backlog) >= self._max_waiting:
            raise QueueFull(
                f"model '{self.label}': all {self.table.slots} sequence slots are held and "
                f"{len(self._backlog)} starts wait for one (batching.max_queue_size); "
                "try again later"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, fut)
        self._backlog.append(entry)
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - self._clock()))
        except BaseException as exc:
            # Given up (deadline, client gone): its place frees at once, so that it
            # no longer counts against max_queue_size. (A slot handed to it as it gave
            # up comes back when the caller closes the sequence.)
            if not fut.done() or fut.cancelled():
                with contextlib.suppress(ValueError):
                    self._backlog.remove(entry)
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            raise Unavailable(
                f"model '{self.label}': no sequence slot came free within the request's "
                f"deadline (all {self.table.slots} are held by active sequences); end "
                "sequences, or try again later"
            ) from None

    async def _wait_turn(self, seq: Sequence, deadline: float) -> None:
        """Wait until the requests of ``seq`` before this one are answered."""
        if not seq.busy:
            seq.busy = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq.waiters.append(fut)
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - self._clock()))
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self._pass_turn(seq)  # handed the turn as it gave up: hand it on
            if isinstance(exc, asyncio.TimeoutError):
                raise DeadlineExceeded(
                    f"request deadline passed while it waited for the previous request of "
                    f"sequence {describe(seq.id)} of model '{self.label}'"
                ) from None
            raise

    def _pass_turn(self, seq: Sequence) -> None:
        """The turn of ``seq`` to its next waiting request, if any."""
        while seq.waiters:
            fut = seq.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        seq.busy = False

    def _close(self, seq: Sequence, why: str) -> None:
        """End ``seq``; a slot it frees goes to the first start waiting for one."""
        if self.table.close(seq, why):
            self._hand_on_slot()

    def _hand_on_slot(self) -> None:
        """A slot came free: to the first start still waiting for one, if any."""
        while self._backlog:
            waiting, fut = self._backlog.popleft()
            if fut.done():
                continue  # gave up (deadline, client gone): its close took care of it
            taken = self.table.take_slot(waiting)
            assert taken
            fut.set_result(None)
            return

    # --- what the model sees --------------------------------------------------------

    def fill(
        self, inputs: dict[str, np.ndarray], seq: Sequence, info: SequenceInfo
    ) -> dict[str, np.ndarray]:
        if not self._controls and not self._states:
            return inputs
        filled = dict(inputs)
        for kind, name, spec in self._controls:
            if kind == "corrid":
                if spec.datatype == "BYTES":
                    value: Any = str(info.id).encode()
                    arr = np.empty((1, 1), dtype=object)
                    arr[0, 0] = value
                    filled[name] = arr
                    continue
                value = info.id
            else:
                value = {"start": info.start, "end": info.end, "ready": True}[kind]
            filled[name] = np.full((1, 1), value, dtype=numpy_dtype(spec.datatype))
        for name, _, initial in self._states:
            filled[name] = initial if info.start else seq.implicit.get(name, initial)
        return filled

    def kept(self, slot: int) -> dict[str, np.ndarray] | None:
        """The implicit states kept for the sequence holding ``slot`` (None: a free slot).

        Read on instance threads (``direct``'s padding rows) while the loop
        replaces entries: each value is a fresh array, never written in place.
        """
        seq = self.table.holders.get(slot)
        return None if seq is None else seq.implicit

    def keep(self, outputs: dict[str, np.ndarray], seq: Sequence) -> dict[str, np.ndarray]:
        if not self._states:
            return outputs
        answer = dict(outputs)
        for name, out, _ in self._states:
            value = answer.pop(out, None)
            if value is not None and seq.closed is None:
                seq.implicit[name] = np.array(value[:1])  # a copy: the batch's array is shared
        return answer

    # --- the idle timer and the end -------------------------------------------------

    def _arm_timer(self) -> None:
        """Wake at the next idle sequence's expiry, unless a timer is armed already
        (it re-arms itself when it fires)."""
        if self._timer is not None or self._closed:
            return
        at = self.table.next_expiry()
        if at is None:
            return
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, at - self._clock()), self._on_timer
        )

    def _on_timer(self) -> None:
        self._timer = None
        for seq in self.table.expire(self._clock()):
            log.info(
                "model %s: sequence %s freed after %.3f s idle", self.label, describe(seq.id),
                self.table.idle_s,
            )  # fmt: skip
            if seq.slot is not None:
                self._hand_on_slot()
        self._arm_timer()

    def close(self) -> None:
        """The runtime unloads: no new sequence request; starts waiting for a slot
        are refused; the timer stops."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._backlog:
            _, fut = self._backlog.popleft()
            if not fut.done():
                fut.set_exception(
                    Unavailable(f"model '{self.label}' is unloading: its sequences are over")
                )


def sequence_config(config: ModelConfig) -> dict[str, Any]:
    """A model's ``sequence_batching`` as Triton's ModelSequenceBatching (its JSON form)."""
    sb = config.sequence_batching
    assert sb is not None
    specs = {s.name: s for s in config.inputs}
    doc: dict[str, Any] = {"max_sequence_idle_microseconds": sb.max_sequence_idle_microseconds}
    if sb.strategy == "oldest":
        doc["oldest"] = {"max_candidate_sequences": slot_count(config)}
    else:
        doc["direct"] = {}
    controls = [
        {"name": name, "control": [_control(kind, specs[name].datatype)]}
        for kind, name in sb.control_inputs.named()
    ]
    if controls:
        doc["control_input"] = controls
    states = []
    for st in sb.state:
        spec = specs[st.input]
        dtype = "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}"
        state: dict[str, Any] = {
            "input_name": st.input,
            "output_name": st.output,
            "data_type": dtype,
            "dims": list(spec.shape),
        }
        # Triton's initial state is zeros or a file's data; another value is shown
        # among the model's parameters (sequence_initial_values).
        if st.initial_value == 0:
            state["initial_state"] = [
                {"data_type": dtype, "dims": list(spec.shape), "zero_data": True,
                 "name": f"{st.input}_initial"}
            ]  # fmt: skip
        states.append(state)
    if states:
        doc["state"] = states
    return doc


def sequence_initial_values(config: ModelConfig) -> list[tuple[str, Any]]:
    """The implicit states whose first value is not zero, as settings with no Triton
    field (``sequence_initial_value.<input>``)."""
    sb = config.sequence_batching
    if sb is None:
        return []
    return [(f"sequence_initial_value.{st.input}", st.initial_value) for st in sb.state
            if st.initial_value != 0]  # fmt: skip


_KINDS = {
    "start": "CONTROL_SEQUENCE_START",
    "end": "CONTROL_SEQUENCE_END",
    "ready": "CONTROL_SEQUENCE_READY",
    "corrid": "CONTROL_SEQUENCE_CORRID",
}


def _control(kind: str, datatype: str) -> dict[str, Any]:
    """One of Triton's ``control`` entries for a control input of ``datatype``."""
    entry: dict[str, Any] = {"kind": _KINDS[kind]}
    if kind == "corrid":
        entry["data_type"] = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
    elif datatype == "BOOL":
        entry["bool_false_true"] = [False, True]
    elif datatype.startswith("FP"):
        entry["fp32_false_true"] = [0.0, 1.0]
    else:
        entry["int32_false_true"] = [0, 1]
    return entry
