"""The continuous batcher of one decoder model: iteration-level scheduling on the loop.

Layer: ``loop``; runs on the event loop only; the decisions come from
:mod:`aserve.sched.step_policy`. Exactly one engine step is in flight at a
time, on the model's step executor (an :class:`~aserve.workers.job.Executor`:
the step thread of :mod:`aserve.workers.step_executor` or the step process of
:mod:`aserve.workers.step_process`). When it comes back,
the outputs go into each request's :class:`~aserve.loop.channel.TokenChannel`
and the next step is formed at once: finished, cancelled and expired
sequences have left, waiting ones are admitted as slots and the prefill
budget allow, paused ones (their reader is behind) sit out. The loop never
waits for the thread; while a step runs, arrivals just queue.

Run-ahead: a step process (a :class:`~aserve.workers.job.RunAhead`, with
``run_ahead`` > 0) goes on decoding the sequences of its last answered step
on its own, and hands each such step back unasked (a job of its own, its
``stepped`` the sequences). The batcher takes their outputs as any step's,
and submits a step only when the plan differs from what the executor
already decodes (``_coast``): an admission, a slot to free, a paused or
resumed reader. Outputs for a request that is done (cancelled, expired) are
dropped, as those of a step in flight always were; the executor drops those
of sequences it was told to free.

Priority (vLLM's ``priority``, lower first, 0 by default): waiting sequences
are admitted by priority, then by deadline; a running one is never preempted.
A request that finds the queue full takes the place of the least urgent one
waiting (the last of the highest priority value) when that one's priority is
less urgent than its own: that one is answered QueueFull (429), saying so;
otherwise the arrival is refused, as with no priorities.

Slots: the loop counts the KV-cache slots it has handed out. A sequence
that finishes frees its slot inside the step; one that is cancelled or
expires while holding a slot is freed by the thread at the start of the next
step (``StepJob.free``), which is when that slot can be reused.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aserve.config import GenerationConfig
from aserve.errors import (
    AserveError,
    DeadlineExceeded,
    ErrorCode,
    InternalError,
    InvalidArgument,
    QueueFull,
    Unavailable,
)
from aserve.loop.channel import TokenChannel
from aserve.obs.logs import CURRENT
from aserve.obs.stats import ModelStats
from aserve.sched.step_policy import RunningView, StepLimits, WaitingView, plan_step
from aserve.types.generation import Delta, StepOutput
from aserve.workers.job import Executor, RunAhead, StepJob

if TYPE_CHECKING:
    from aserve.engines.decoder import Sequence

log = logging.getLogger("aserve.continuous")

_ids = itertools.count(1)


def _member_error(label: str, out: StepOutput) -> AserveError:
    if out.error_code == ErrorCode.INVALID_ARGUMENT.value:
        return InvalidArgument(f"model '{label}' refused the request: {out.error}")
    return InternalError(f"model '{label}' failed: {out.error}")


class _Step(StepJob):
    """A step in the executor, as the loop tracks it: it is the job it submits."""

    def __init__(
        self,
        new: list[GenerationRequest],
        decode: list[GenerationRequest],
        free: list[GenerationRequest],
        on_done: Callable[[_Step], None],
    ) -> None:
        self.new = [r.sequence for r in new]
        self.running = [r.sequence for r in decode]
        self.free = [r.sequence for r in free]
        self.on_done = on_done
        self.reqs = new + decode  # in the order of the outputs


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"  # finished, failed, expired or cancelled: the batcher is done with it


class GenerationRequest:
    """One generation request on the loop: its sequence, deadline and token stream.

    The frontend reads it as an async iterator of :class:`Delta` (the last
    one has a ``finish_reason``; a failure raises its :class:`AserveError`
    after the text already produced) and uses it as an async context
    manager: leaving the ``async with`` early, by an error or by the task
    being cancelled because the client went away, cancels the sequence,
    which then leaves the batch at the next step.
    """

    __slots__ = (
        "_batcher",
        "admitted",
        "arrival",
        "channel",
        "client_id",
        "deadline",
        "holds_slot",
        "id",
        "last_token",
        "priority",
        "prompt_tokens",
        "sequence",
        "state",
    )

    def __init__(
        self,
        batcher: ContinuousBatcher,
        sequence: Sequence,
        prompt_tokens: int,
        arrival: float,
        deadline: float,
        channel: TokenChannel,
        client_id: str | None,
        priority: int = 0,
    ) -> None:
        self.id = next(_ids)
        self._batcher = batcher
        self.sequence = sequence  # handed to the step thread; the loop never reads it again
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.deadline = deadline
        self.channel = channel
        self.client_id = client_id
        self.priority = priority  # lower is admitted first (vLLM's)
        self.state = State.WAITING
        self.admitted = 0.0
        self.holds_slot = False
        self.last_token = 0.0  # when the step that gave its latest token ended; 0: none yet

    def __lt__(self, other: GenerationRequest) -> bool:
        """The order within one priority: earliest deadline first (arrival order
        among equal timeouts)."""
        return (self.deadline, self.id) < (other.deadline, other.id)

    @property
    def log_id(self) -> str:
        return f"{self.id}" if self.client_id is None else f"{self.id}/{self.client_id}"

    def __aiter__(self) -> TokenChannel:
        return self.channel

    async def __anext__(self) -> Delta:
        return await self.channel.__anext__()

    def cancel(self) -> None:
        """The reader is gone: stop generating (no-op once the request is done)."""
        self._batcher.cancel(self)

    async def __aenter__(self) -> GenerationRequest:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()
        info = CURRENT.get()
        if info is not None and self.admitted:  # for the access log: waiting for a slot
            info.queue_s = self.admitted - self.arrival

    async def collect(self) -> tuple[str, Delta | None]:
        """The whole text and the last delta (None if nothing came), for unary answers."""
        parts, last = [], None
        async for delta in self.channel:
            parts.append(delta.text)
            last = delta
        return "".join(parts), last


class WaitingQueue:
    """The sequences waiting for a slot: one list per priority, each in deadline order.

    A model's requests mostly share one priority, so ``levels`` is short and
    looking at each level's head costs little; a level leaves once empty.
    """

    __slots__ = ("_levels", "_order", "_size")

    def __init__(self) -> None:
        self._levels: dict[int, list[GenerationRequest]] = {}
        self._order: list[int] = []  # the priorities of the levels, most urgent first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def levels(self) -> list[list[GenerationRequest]]:
        """Each priority's queue, most urgent first (the lists themselves)."""
        return [self._levels[p] for p in self._order]

    def add(self, req: GenerationRequest) -> None:
        level = self._levels.get(req.priority)
        if level is None:
            level = self._levels[req.priority] = []
            bisect.insort(self._order, req.priority)
        bisect.insort(level, req)
        self._size += 1

    def remove(self, req: GenerationRequest) -> None:
        level = self._levels[req.priority]
        level.remove(req)
        self._size -= 1
        if not level:
            self._drop(req.priority)

    def take_heads(self, counts: dict[int, int]) -> dict[int, list[GenerationRequest]]:
        """Take the first ``counts[k]`` requests of level ``k`` (an index into
        :meth:`levels` as it was), for each ``k`` given."""
        taken = {}
        for k, n in counts.items():
            priority = self._order[k]
            level = self._levels[priority]
            taken[k], level[:n] = level[:n], []
            self._size -= n
        for priority in [p for p in self._order if not self._levels[p]]:
            self._drop(priority)
        return taken

    def expire(self, now: float) -> list[GenerationRequest]:
        """Take every request whose deadline has passed (each level's head)."""
        out = []
        for priority in list(self._order):
            level = self._levels[priority]
            i = 0
            while i < len(level) and level[i].deadline <= now:
                i += 1
            out += level[:i]
            del level[:i]
            self._size -= i
            if not level:
                self._drop(priority)
        return out

    def earliest_deadline(self) -> float | None:
        return min((self._levels[p][0].deadline for p in self._order), default=None)

    def least_urgent(self) -> GenerationRequest | None:
        """The one that would be admitted last: the latest deadline of the highest
        priority value."""
        return self._levels[self._order[-1]][-1] if self._order else None

    def counts(self) -> dict[int, int]:
        """Waiting sequences per priority, most urgent first."""
        return {p: len(self._levels[p]) for p in self._order}

    def clear(self) -> list[GenerationRequest]:
        out = [r for p in self._order for r in self._levels[p]]
        self._levels.clear()
        self._order.clear()
        self._size = 0
        return out

    def _drop(self, priority: int) -> None:
        del self._levels[priority]
        self._order.remove(priority)


class ContinuousBatcher:
    def __init__(
        self,
        label: str,
        generation: GenerationConfig,
        executor: Executor[StepJob],
        stats: ModelStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.limits = StepLimits(generation.max_num_seqs, generation.max_prefill_tokens)
        self.max_queue_size = generation.max_queue_size
        self.buffer_chunks = generation.stream_buffer_chunks
        self._executor = executor
        executor.on_live = self.resume
        self._stats = stats
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._waiting = WaitingQueue()  # by priority, then (deadline, id)
        self._running: dict[int, GenerationRequest] = {}  # by id, in admission order
        self._to_free: dict[int, GenerationRequest] = {}  # left the batch, slot not yet freed
        self._slots_held = 0
        self._in_flight: StepJob | None = None
        # A step process decodes the running set of its last answered step on
        # its own (run-ahead) and answers those steps unasked: the batcher then
        # submits a step only when that set changes. ``_coast`` holds the ids of
        # the requests it decodes so (None: it waits for a step); executors
        # that are no RunAhead never step unasked.
        self._run_ahead = isinstance(executor, RunAhead) and executor.run_ahead > 0
        self._coast: set[int] | None = None
        # The request of each sequence an executor may still answer for.
        self._by_seq: dict[Any, GenerationRequest] = {}
        self._step_soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when it fires (the clock's time), while it is armed
        self._closed = False
        # Observability (the model's statistics).
        self.steps = 0
        self.ahead_steps = 0  # steps the executor ran on its own
        self.generated_tokens = 0
        self.prompt_tokens = 0
        # Finished sequences whose prompt began with a prefix-cache hit, and its tokens.
        self.prefix_cache_hits = 0
        self.cached_prompt_tokens = 0
        self.step_batch_sizes: dict[int, int] = {}

    # --- state seen by others -------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Sequences in the batch (paused ones included)."""
        return len(self._running)

    @property
    def paused(self) -> int:
        return sum(1 for r in self._running.values() if r.channel.paused)

    @property
    def slots_held(self) -> int:
        """KV-cache slots taken, those of sequences waiting to be freed included."""
        return self._slots_held

    @property
    def step_in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running and self._in_flight is None

    # --- requests in and out ----------------------------------------------------

    def check_room(self, preparing: int = 0, priority: int = 0) -> None:
        """Raise now what :meth:`submit` would for want of room (QueueFull, or
        Unavailable while unloading), so that a frontend refuses before it
        tokenizes: under a retry storm every refusal is loop time taken from
        the running streams' steps and SSE writes. ``preparing``: requests not
        queued yet because their prompts are being rendered and tokenized; they
        take places in the queue too, so that the line in front of a model's
        chat-template thread is as bounded as the queue behind it. A request
        of ``priority`` finds room in a full queue that holds a less urgent one
        (whose place it takes at :meth:`submit`)."""
        if self._closed:
            raise Unavailable(f"model '{self.label}' is unloading")
        if self._full(preparing) and self._displaceable(priority) is None:
            self._stats.rejected["queue_full"] += 1
            urgency = ""
            if priority or any(self._waiting.counts()):  # named only where in use
                urgency = f", none less urgent than this one's priority {priority},"
            raise QueueFull(
                f"model '{self.label}' queue is full: {len(self._waiting)} sequences waiting "
                f"for a slot{urgency} and {preparing} being prepared (generation.max_queue_size "
                f"{self.max_queue_size}); retry later"
            )

    def _full(self, preparing: int = 0) -> bool:
        # Sequences that the next step admits into free slots are not queued:
        # a burst of max_num_seqs + max_queue_size is taken by an idle model.
        free_slots = self.limits.max_num_seqs - (self._slots_held - len(self._to_free))
        return len(self._waiting) + preparing >= self.max_queue_size + max(free_slots, 0)

    def _displaceable(self, priority: int) -> GenerationRequest | None:
        """The waiting request an arrival of ``priority`` may push out of a full
        queue: the least urgent one, if its priority is less urgent."""
        last = self._waiting.least_urgent()
        return last if last is not None and last.priority > priority else None

    def _displace(self, priority: int) -> None:
        """Make room in a full queue for an arrival of ``priority``: the least
        urgent waiting request leaves with QueueFull, naming why."""
        out = self._displaceable(priority)
        assert out is not None  # check_room() refuses the arrival otherwise
        self._waiting.remove(out)
        self._stats.rejected["queue_full"] += 1
        log.debug(
            "generation %s on '%s' (priority %d) displaced by one of priority %d",
            out.log_id, self.label, out.priority, priority,
        )  # fmt: skip
        self._end(out, QueueFull(
            f"model '{self.label}' queue is full (generation.max_queue_size "
            f"{self.max_queue_size}) and a more urgent request (priority {priority}) took "
            f"the place of this one (priority {out.priority}; lower is served first); "
            "retry later"
        ))  # fmt: skip

    def submit(
        self,
        sequence: Sequence,
        prompt_tokens: int,
        timeout_s: float,
        client_id: str | None = None,
        *,
        arrival: float | None = None,
        priority: int = 0,
    ) -> GenerationRequest:
        """Queue a prepared sequence, or raise at once (QueueFull / Unavailable /
        DeadlineExceeded). Its deadline is ``arrival`` (when the frontend read its
        first bytes; None: now) + ``timeout_s``; the request's own ``arrival``
        is now, when it joins the queue (its statistics count from there).
        ``priority``: lower is admitted first; at a full queue, a request takes
        the place of a less urgent one waiting (which fails with QueueFull)."""
        self.check_room(priority=priority)
        now = self._clock()
        deadline = (now if arrival is None else arrival) + timeout_s
        if deadline <= now:  # spent before it came here
            raise DeadlineExceeded(f"request deadline already passed on arrival at '{self.label}'")
        if self._full():  # check_room found a less urgent one to push out
            self._displace(priority)
        channel = TokenChannel(self.buffer_chunks, on_resume=self._kick)
        req = GenerationRequest(
            self, sequence, prompt_tokens, now, deadline, channel, client_id, priority
        )
        self._waiting.add(req)
        self._kick()
        return req

    def cancel(self, req: GenerationRequest) -> None:
        """The reader went away: drop ``req`` from the queue or the batch."""
        if req.state is State.DONE:
            return
        if req.state is State.WAITING:
            self._waiting.remove(req)
        else:
            del self._running[req.id]
            self._to_free[req.id] = req
        req.state = State.DONE
        req.channel.close()
        self._stats.cancelled += 1
        log.debug("generation %s on '%s' cancelled", req.log_id, self.label)
        self._kick()

    def _end(self, req: GenerationRequest, error: AserveError) -> None:
        """End a waiting or running request with ``error``."""
        if req.state is State.RUNNING:
            del self._running[req.id]
            if req.holds_slot:
                self._to_free[req.id] = req
        req.state = State.DONE
        req.channel.fail(error)
        self._stats.fail.add(int((self._clock() - req.arrival) * 1e9))

    # --- forming steps ----------------------------------------------------------

    def _kick(self) -> None:
        """Something changed: form a step soon, unless one is in flight.

        ``call_soon`` coalesces the arrivals parsed in one pass of the loop,
        so they are admitted (and prefilled) together.
        """
        if self._in_flight is not None:
            self._watch_waiting()  # a new arrival's deadline may come first
        elif not self._step_soon and not self._closed:
            self._step_soon = True
            self._loop.call_soon(self._form_step)

    def _watch_waiting(self) -> None:
        """While a step runs, a timer for the earliest deadline of the waiting
        requests: a step that takes long (a long prefill, a step process held
        up) must not keep them past their deadlines, which the next plan would
        otherwise be the first to see."""
        at = self._waiting.earliest_deadline()
        if at is not None and (self._timer is None or at < self._timer_at):
            self._arm_timer(at)

    def _form_step(self) -> None:
        self._step_soon = False
        if self._in_flight is not None or self._closed:
            return
        now = self._clock()
        if self._executor.live <= 0:
            self._hold_queue(now)
            return
        running = list(self._running.values())
        for r in running:
            if r.channel.full:
                r.channel.paused = True
        levels = self._waiting.levels()
        plan = plan_step(
            now,
            [RunningView(r.deadline, r.channel.paused) for r in running],
            [(WaitingView(w.deadline, w.prompt_tokens) for w in level) for level in levels],
            # Slots of sequences that left since the last step are freed first.
            self._slots_held - len(self._to_free),
            self.limits,
        )
        for i in plan.expire_running:
            r = running[i]
            self._time_out(r, (
                f"generation timed out after {(now - r.arrival) * 1e3:.0f} ms "
                f"({r.channel.backlog} step(s) unread by the client) on '{self.label}'"
            ))  # fmt: skip
        heads: dict[int, list[GenerationRequest]] = {}
        if plan.expire_waiting or plan.admit:
            # What the plan takes of each level is a prefix of it.
            counts: dict[int, int] = {}
            for q, _ in (*plan.expire_waiting, *plan.admit):
                counts[q] = counts.get(q, 0) + 1
            heads = self._waiting.take_heads(counts)
        for q, i in plan.expire_waiting:
            w = heads[q][i]
            self._time_out(w, (
                f"generation timed out after {(now - w.arrival) * 1e3:.0f} ms waiting for a "
                f"slot of '{self.label}'"
            ))  # fmt: skip
        new = [heads[q][i] for q, i in plan.admit]
        decode = [running[i] for i in plan.decode]
        if not new and not self._to_free and self._goes_on(decode):
            self._arm_timer(plan.wake_at)
            return
        free = list(self._to_free.values())
        self._to_free.clear()
        self._disarm_timer()
        by_seq = self._by_seq
        for r in free:
            r.holds_slot = False
            by_seq.pop(r.sequence, None)  # the executor drops what it still answers for it
        self._slots_held -= len(free)
        queue_ns = 0
        observe_queue = self._stats.queue_seconds.observe
        for r in new:
            r.state = State.RUNNING
            r.admitted = now
            r.holds_slot = True
            self._running[r.id] = r
            by_seq[r.sequence] = r
            queue_ns += int((now - r.arrival) * 1e9)
            observe_queue(now - r.arrival)
        if new:
            self._stats.queue.add(queue_ns, len(new))
        self._slots_held += len(new)
        job = _Step(new, decode, free, self._on_step_done)
        self._in_flight = job
        self._executor.submit(job)
        self._watch_waiting()

    def _goes_on(self, decode: list[GenerationRequest]) -> bool:
        """Whether decoding ``decode`` (and nothing else) needs no step submitted:
        the executor already decodes exactly these on its own, or nothing runs."""
        coast = self._coast
        if not coast:
            return not decode
        return len(decode) == len(coast) and all(r.id in coast for r in decode)

    def _on_step_done(self, job: StepJob) -> None:
        """A step came back from the executor (called on the loop): the one
        submitted, or one it ran ahead on its own."""
        asked = job is self._in_flight
        if asked:
            self._in_flight = None
        else:
            self.ahead_steps += 1
        t0 = time.perf_counter_ns()
        if asked and job.stepped is None:
            reqs: list[GenerationRequest | None] = job.reqs  # type: ignore[attr-defined]
        else:
            by_seq = self._by_seq
            seqs = job.stepped if job.stepped is not None else job.running
            reqs = [by_seq.get(s) for s in seqs]
        if job.error is not None:
            self._coast = None  # the executor waits for the next step
            self._step_failed(job, [r for r in reqs if r is not None])
        else:
            now = self._clock()
            stats = self._stats
            if asked and self._run_ahead:
                self._coast = set()  # from now on it decodes these unasked
            coast = self._coast
            for req, out in zip(reqs, job.outputs, strict=True):
                if req is None:
                    continue  # freed since (the executor should have dropped it)
                if out.finished:
                    self._by_seq.pop(req.sequence, None)
                    if coast is not None:
                        coast.discard(req.id)
                    if req.holds_slot:
                        # The engine freed the slot when the sequence finished.
                        req.holds_slot = False
                        self._slots_held -= 1
                        self._to_free.pop(req.id, None)
                elif asked and coast is not None:
                    coast.add(req.id)
                if req.state is not State.RUNNING:
                    continue  # cancelled or expired while the step ran: nobody reads it
                if out.error is not None:  # this member failed alone; the others go on
                    self._end(req, _member_error(self.label, out))
                    continue
                if out.prefilling:  # a chunk of its prompt ran; no token for the reader yet
                    continue
                req.channel.push(out)
                # One token per sequence per step: the first after the request
                # arrived, the others after the previous step that gave one.
                if req.last_token:
                    stats.inter_token_seconds.observe(now - req.last_token)
                else:
                    stats.first_token_seconds.observe(now - req.arrival)
                req.last_token = now
                if out.finished:
                    req.state = State.DONE
                    del self._running[req.id]
                    stats.success.add(int((now - req.arrival) * 1e9))
                    self.prompt_tokens += out.prompt_tokens
                    if out.cached_tokens:
                        self.prefix_cache_hits += 1
                        self.cached_prompt_tokens += out.cached_tokens
            n = len(job.outputs)
            if n:
                # A step that only prefilled chunks (no token) still counts as a step.
                self.steps += 1
                self.generated_tokens += sum(not o.prefilling for o in job.outputs)
                self.step_batch_sizes[n] = self.step_batch_sizes.get(n, 0) + 1
                stats.record_batch(n, n, 0, job.infer_ns, time.perf_counter_ns() - t0)
        self._form_step()

    def _hold_queue(self, now: float) -> None:
        """The engine is being replaced: no step runs, waiting sequences stay
        queued for it (``resume``), and leave only when their deadline passes."""
        for w in self._waiting.expire(now):
            self._time_out(w, (
                f"generation timed out after {(now - w.arrival) * 1e3:.0f} ms waiting for "
                f"'{self.label}' (its step process is restarting)"
            ))  # fmt: skip
        self._arm_timer(self._waiting.earliest_deadline())

    def _time_out(self, req: GenerationRequest, message: str) -> None:
        self._stats.timed_out += 1
        self._end(req, DeadlineExceeded(message))

    def resume(self) -> None:
        """The executor's ``live`` changed: once it is back (a new step process
        is up), steps run again."""
        if self._executor.live > 0:
            self._kick()

    def _requeue(self, reqs: list[GenerationRequest]) -> None:
        """Sequences of a step that never reached the engine wait again, in order."""
        for req in reqs:
            self._by_seq.pop(req.sequence, None)
            if req.state is not State.RUNNING:
                continue  # cancelled or expired meanwhile
            del self._running[req.id]
            if req.holds_slot:
                req.holds_slot = False
                self._slots_held -= 1
            req.state = State.WAITING
            self._waiting.add(req)

    def _step_failed(self, job: StepJob, reqs: list[GenerationRequest]) -> None:
        if job.not_run:
            # Nothing ran: the new sequences never held anything in the engine,
            # so they wait for it again; running ones are ended by fail_running
            # when the engine reports them lost.
            self._requeue(reqs[: len(job.new)])
            return
        # The engine gave the new sequences' slots back; the running ones
        # still hold theirs and are freed at the next step.
        log.warning("step of %d sequence(s) on '%s' failed: %r", len(reqs), self.label, job.error)
        error = InternalError(f"model '{self.label}' failed: {job.error}")
        for req in reqs[: len(job.new)]:
            self._by_seq.pop(req.sequence, None)
            if req.holds_slot:
                req.holds_slot = False
                self._slots_held -= 1
                self._to_free.pop(req.id, None)
        for req in reqs:
            if req.state is State.RUNNING:
                self._end(req, error)
            if not req.holds_slot:
                self._to_free.pop(req.id, None)

    def _arm_timer(self, wake_at: float | None) -> None:
        self._disarm_timer()
        if wake_at is not None:
            self._timer_at = wake_at
            self._timer = self._loop.call_later(max(0.0, wake_at - self._clock()), self._on_timer)

    def _disarm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._in_flight is None:
            self._kick()
            return
        now = self._clock()
        for w in self._waiting.expire(now):
            self._time_out(w, (
                f"generation timed out after {(now - w.arrival) * 1e3:.0f} ms waiting for a "
                f"slot of '{self.label}'"
            ))  # fmt: skip
        self._watch_waiting()

    def fail_running(self, error: BaseException) -> None:
        """The engine lost every started sequence (its step process died):
        end each running request; waiting ones stay queued for the new engine."""
        failure = InternalError(f"model '{self.label}' failed: {error}")
        self._coast = None
        for req in list(self._running.values()):
            self._end(req, failure)
        self._kick()

    # --- shutdown -------------------------------------------------------------

    def close(self) -> None:
        """Refuse new requests; end every waiting and running one as unavailable."""
        self._closed = True
        self._disarm_timer()
        error = Unavailable(f"model '{self.label}' is unloading")
        for req in [*self._waiting.clear(), *self._running.values()]:
            self._end(req, error)

    def statistics(self) -> dict[str, Any]:
        """aserve's generation gauges and counters, for the model's statistics."""
        return {
            "waiting_sequence_count": self.waiting,
            "running_sequence_count": self.running,
            "paused_sequence_count": self.paused,
            # By priority (vLLM's: lower is admitted first), most urgent first.
            "waiting_by_priority": {str(p): n for p, n in self._waiting.counts().items()},
            "kv_slots_in_use": self._slots_held,
            "max_num_seqs": self.limits.max_num_seqs,
            "step_count": self.steps,
            "ahead_step_count": self.ahead_steps,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "prefix_cache_hits": self.prefix_cache_hits,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "step_batch_sizes": {str(k): v for k, v in sorted(self.step_batch_sizes.items())},
        }
