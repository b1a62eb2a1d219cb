"""The loop-side batcher of one model: queue, admission, timers, dispatch.

Layer: ``loop``; runs on the event loop only. It depends on the
:class:`~aserve.workers.job.Executor` protocol, not on a concrete pool: a
thread pool, worker processes or several device pools take its batches. The
decisions come from :mod:`aserve.sched.policy` and the estimates from
:mod:`aserve.sched.latency`; this module keeps the state they need and
carries them out:

- ``submit`` admits a request or refuses it at once (queue full, or its
  deadline cannot be met given the queue ahead and measured latencies).
- The queue is a heap by deadline. Cancelled requests are marked and skipped
  lazily; expired ones are answered with a timeout when they reach the top,
  and a timer wakes the batcher at the earliest deadline so none waits long.
- Times are ``clock()`` seconds, ``time.monotonic()`` unless a test injects a
  fake (uvloop's ``loop.time()`` has only millisecond resolution, too coarse
  for latency estimates); timers are armed with ``call_later``, their delays
  computed from the same clock.
- ``_pump`` runs the policy whenever something changes: an arrival (coalesced
  with ``call_soon``, so requests parsed in the same loop pass batch
  together), a finished batch, or a timer.
- **The next batch, staged.** While every instance is busy, an executor that
  can (:class:`~aserve.workers.job.Staging`: the thread pool) is handed the
  batch the policy would cut if an instance were free, and the first
  instance to free up runs it at once, without waiting for the loop's turn.
  Until an instance takes it, each pump makes it the batch the loop would cut
  then: grown from the queue, or taken back and cut again. Its states and the
  lock shared with the instances are :mod:`aserve.loop.staged_batch`'s; here
  are the decisions and the timers.
- **A shared device.** On a device whose models share it
  (:mod:`aserve.loop.device_scheduler`), a batch also needs one of the
  device's slots: a batcher that finds none free waits with the others, and
  the device hands the next free slot to the one with the most urgent batch
  (:meth:`claim`; it then cuts its batch in :meth:`granted`). No batch is
  staged there: which model runs next is the device's choice, made when a
  slot frees up.
- **Priority levels** (Triton's): the queue is ordered by level first (1 the
  highest), then deadline. Admission counts, ahead of a request, only the
  work of its own level and higher; each level has its own queue limit, and
  a level whose policy says ``DELAY`` keeps a request that reached its
  deadline in the queue, behind all others, instead of timing it out.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from aserve.config import BatchingConfig
from aserve.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    QueueFull,
    Unavailable,
)
from aserve.loop.loop_lag import LoopLag
from aserve.loop.request import InferenceRequest
from aserve.loop.staged_batch import Seen, StagedBatch
from aserve.obs.stats import ModelStats
from aserve.sched.device_policy import Claim
from aserve.sched.latency import AdmissionMargin, ArrivalRate, Echoes, LatencyModel
from aserve.sched.policy import BatchLimits, Echo, QueueView, deadline_cap, plan, predicted_finish
from aserve.workers.job import BatchJob, Executor, Inline, Staging

if TYPE_CHECKING:
    from aserve.loop.device_scheduler import DeviceScheduler

log = logging.getLogger("aserve.batcher")


class _Running(BatchJob):
    """A batch in an executor, as the loop tracks it: it is the job it submits."""

    def __init__(
        self,
        requests: list[InferenceRequest],
        size: int,
        started: float,
        expected_end: float,
        on_done: Callable[[_Running], None],
    ):
        self.parts = [r.inputs for r in requests]
        self.size = size
        self.on_done = on_done
        self.requests = requests
        self.started = started
        self.expected_end = expected_end
        self.timer: asyncio.TimerHandle | None = None
        # The shared device it holds a slot of, and its token there (None: none).
        self.device: DeviceScheduler | None = None
        self.slot = 0
        # The earliest deadline in it: its deadline guard's, kept up while it is
        # staged and grows or shrinks (aserve.loop.staged_batch).
        self.earliest = min(r.deadline for r in requests)


class Batcher:
    def __init__(
        self,
        label: str,
        batching: BatchingConfig,
        pool: Executor[BatchJob],
        stats: ModelStats,
        clock: Callable[[], float] = time.monotonic,
        loop_lag: LoopLag | None = None,
    ) -> None:
        self.label = label  # "name/version", for messages
        self._clock = clock
        self._lag = LoopLag.of_running_loop() if loop_lag is None else loop_lag
        self.limits = BatchLimits.build(
            batching.max_batch_size, batching.max_delay_ms, batching.preferred_batch_sizes
        )
        self.max_queue_size = batching.max_queue_size
        self._set_levels(batching)
        self.latency = LatencyModel(batching.max_batch_size)
        self._rate = ArrivalRate()
        self._echoes = Echoes()  # what batch ends bring back (a closed loop's clients)
        self.margin = AdmissionMargin(clock=clock)
        self._quiet_since = clock()  # when it was last seen idle
        # Until when a burst that found it rested is admitted on the measured latencies
        # alone (see check_admission).
        self._fresh_until = -math.inf
        self._pool = pool
        self._stats = stats
        self._loop = asyncio.get_running_loop()
        self._heap: list[InferenceRequest] = []  # by deadline; may hold stale entries
        self._fifo: deque[InferenceRequest] = deque()  # by arrival; may hold stale entries
        self._queued_requests = 0
        # Requests a stage ahead of this batcher holds (a handler model's, in
        # preprocessing), admitted by reserve() and queued here once through it.
        self._reserved_requests = 0
        self._reserved_items = 0
        self._queued_items = 0
        self._running: set[_Running] = set()
        self._stager = pool if isinstance(pool, Staging) else None
        self._inline = pool if isinstance(pool, Inline) else None
        self._staged: StagedBatch[_Running] | None = None  # not known to be running
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._pump_soon = False
        self._arrived = 0  # requests submitted since the last pump
        self._alone = True  # the last pump after arrivals found only one
        self._closed = False
        self._device: DeviceScheduler | None = None
        # Requests past their deadline wait in the queue's order, which puts a
        # higher level first: with more than one level in it, they are found by
        # deadline alone here (deadline, seq, request), stale entries included.
        self._expiry: list[tuple[float, int, InferenceRequest]] = []
        pool.on_live = self._on_live

    def _set_levels(self, batching: BatchingConfig) -> None:
        """Take the priority levels and their queue policies of ``batching``."""
        levels = max(batching.priority_levels, 1)
        self.levels = levels
        self.default_level = batching.default_priority_level or 1
        policies = [batching.queue_policy(level) for level in range(1, levels + 1)]
        # By level, 1..levels, and levels + 1 for DELAY's requests past their deadline.
        self._level_limit = [math.inf] + [p.max_queue_size or math.inf for p in policies]
        self._delays = [False] + [p.timeout_action == "DELAY" for p in policies]
        self.delayed_level = levels + 1
        # Each level's own timeout (None: the model's) and whether a request may name another.
        self._timeouts: list[tuple[float | None, bool]] = [(None, True)] + [
            (None if p.default_timeout_microseconds is None else p.default_timeout_microseconds
             / 1e6, p.allow_timeout_override)
            for p in policies
        ]  # fmt: skip
        # Whether a request's level or deadline depends on it at all (not by default).
        self.leveled = levels > 1 or any(t != (None, True) for t in self._timeouts)
        self._by_level = batching.priority_levels > 1 or any(self._delays)
        self._level_requests = [0] * (levels + 2)
        self._level_items = [0] * (levels + 2)

    def level_of(self, priority: int) -> int:
        """The level of a request whose ``priority`` parameter is ``priority`` (0:
        none given); a model without levels has one, 1, whatever is asked."""
        if priority == 0 or self.levels == 1:
            return self.default_level
        if priority > self.levels:
            raise InvalidArgument(
                f"parameter 'priority': {priority} is not a level of model '{self.label}': its levels "
                f"are 1 (the highest) to {self.levels}, or 0 for the default"
            )
        return priority

    def timeout_at(self, level: int, timeout_s: float, model_default_s: float) -> float:
        """The timeout of a request at ``level`` that the frontend resolved to
        ``timeout_s``: the level's own when the request named none (it got the
        model's default, ``model_default_s``) or may not name one."""
        own, override = self._timeouts[level]
        if own is None:
            return timeout_s if override else model_default_s
        if not override or timeout_s == model_default_s:
            return own
        return timeout_s

    @property
    def _own_free(self) -> int:
        """Instances free for a batch: the live ones (a dead one's restart does not
        count) less the batches out, a staged one included. Below 0 while a dead
        instance's batch is out, or a batch is staged behind busy instances."""
        return self._pool.live - len(self._running) - (self._staged is not None)

    @property
    def _free(self) -> int:
        """Batches that may start now: free instances, and on a shared device no
        more than the slots it lets this model take."""
        free = self._pool.live - len(self._running) - (self._staged is not None)
        device = self._device
        if device is None or free <= 0:
            return free
        return min(free, device.free_for(self))

    # --- a shared device ----------------------------------------------------------

    def share(self, device: DeviceScheduler | None) -> None:
        """Run on ``device``'s slots from now on (None: on this model's instances alone).
        Batches running keep the slot they hold until they end."""
        if device is self._device:
            return
        if self._device is not None:
            self._device.leave(self)
        self._device = device
        if device is not None:
            device.join(self)
        if self._queued_requests and not self._pump_soon:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    @property
    def device(self) -> DeviceScheduler | None:
        return self._device

    def claim(self, now: float) -> Claim | None:
        """What this model would run in a free slot of its device now (None: nothing).

        Requests already past their deadline, or hopeless, are answered first (as
        the next pump would), so that the claim is the request the batch is cut for.
        """
        if self._closed or self._own_free <= 0:
            return None
        self._expire_queued(now)
        while self._queued_requests and self._shed_hopeless(now):
            pass
        top = self._top()
        if top is None:
            return None
        feasible = not self.latency.known or now + self.latency.estimate(top.batch_size) <= (
            top.deadline
        )
        return Claim(feasible, top.level, top.deadline, top.seq)

    def granted(self) -> None:
        """The device gave this model a slot for one batch: cut and dispatch it now."""
        self._pump()

    def queued_work(self, now: float, level: int, deadline: float) -> float:
        """Seconds of this model's queued work that the device runs before a request
        of another model at ``level`` with ``deadline`` (see DeviceScheduler.ahead_s)."""
        if not self._queued_requests or not self.latency.known:
            return 0.0
        top = self._top()
        if top is None or (top.level, top.deadline) > (level, deadline):
            return 0.0
        items = self._items_up_to(level)
        full = self.limits.max_batch_size
        batches, rest = divmod(items, full)
        estimate = self.latency.estimate
        return batches * estimate(full) + (estimate(rest) if rest else 0.0)

    def _items_up_to(self, level: int) -> int:
        """Items queued at ``level`` or higher (every one without levels)."""
        if not self._by_level:
            return self._queued_items
        return sum(self._level_items[1 : level + 1])

    def _on_live(self) -> None:
        """An instance died or came back: a batch may run now that could not."""
        if self._queued_requests and not self._pump_soon:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    # --- state seen by others -------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests waiting: in the queue, or in a staged batch no instance has taken
        (as far as the loop knows)."""
        staged = self._staged
        return self._queued_requests + (0 if staged is None else len(staged.batch.requests))

    @property
    def running(self) -> int:
        """Batches in executors (not a staged one)."""
        return len(self._running)

    @property
    def idle(self) -> bool:
        return self._queued_requests == 0 and not self._running and self._staged is None

    # --- requests in ----------------------------------------------------------

    def submit(self, req: InferenceRequest) -> None:
        """Queue ``req`` or raise at once (QueueFull / Unavailable / DeadlineExceeded)."""
        req.predicted = (
            self.check_admission(req.arrival, req.deadline, req.batch_size, level=req.level) or 0.0
        )
        now = req.arrival
        self._rate.observe(now)
        self._echoes.arrived(now, req.batch_size)
        self._arrived += 1
        if self._inline is not None and self._runs_now(req, now):
            self._run_inline(req)
            return
        self._enqueue(req)
        self._fifo.append(req)
        if not self._pump_soon:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    def _runs_now(self, req: InferenceRequest, now: float) -> bool:
        """Whether ``req`` finds the model idle, the policy would run it alone at
        once, and the pool runs a batch of its size inline: the idle fast path."""
        assert self._inline is not None
        if not self._alone or self._pump_soon or not self.idle or self._free <= 0:
            return False
        n = req.batch_size
        if not self._inline.runs_inline(n):
            return False
        view = QueueView(n, now, req.deadline)
        rate = self._rate.per_second(now)
        echo = self._echoes.expected(now)
        return plan(now, view, self._free, self.limits, self.latency.estimate, rate, echo).take == n

    def _enqueue(self, req: InferenceRequest) -> None:
        """Put ``req`` in the queue (not the FIFO: the caller keeps that in order)."""
        req.queued = True
        heapq.heappush(self._heap, req)
        self._queued_requests += 1
        self._queued_items += req.batch_size
        self._level_requests[req.level] += 1
        self._level_items[req.level] += req.batch_size
        if self._by_level:
            heapq.heappush(self._expiry, (req.deadline, req.seq, req))

    def _run_inline(self, req: InferenceRequest) -> None:
        """Run ``req`` as a batch of its own here, inline, and answer it before
        ``submit`` returns: its handler goes on without waiting for a turn of the
        loop (a pump, the batch's answer, the task's wake-up), as the plain
        handler does. The same records as a dispatched batch; no deadline timer,
        since nothing else runs on the loop meanwhile."""
        assert self._inline is not None
        start = self._clock()
        size = self._note_queue_wait([req], start)
        running = _Running([req], size, start, start + self.latency.estimate(size), self._on_done)
        self._running.add(running)
        self._take_slot(running)
        self._inline.run_inline(running)
        self._answer(running)
        # The pump that follows any arrival: requests parsed after this one in the
        # same pass of the loop queue for it and batch together, as they would
        # have without the fast path, and it sees whether they came alone.
        self._pump_soon = True
        self._loop.call_soon(self._pump)

    def reserve(self, now: float, deadline: float, items: int, ready_at: float) -> float | None:
        """Admit now a request of ``items`` that joins the queue only at ``ready_at``
        (after a stage ahead of this batcher): raise what :meth:`submit` would
        refuse it with then, counting the requests reserved before it as queued
        ahead. Returns its prediction, as :meth:`check_admission`. Call
        :meth:`release` once it is queued or given up."""
        predicted = self.check_admission(
            now, deadline, items, self._reserved_requests, self._reserved_items, ready_at
        )
        self._reserved_requests += 1
        self._reserved_items += items
        return predicted

    def release(self, items: int) -> None:
        """A reserved request of ``items`` was queued or given up."""
        self._reserved_requests -= 1
        self._reserved_items -= items

    def answered_late(self, now: float, budget_s: float, ratio: float | None) -> None:
        """An answer of this batcher's reached its client late, or too near its
        deadline, after a stage behind the batch: admission was too optimistic
        (``ratio``: its real time over the predicted one, None when unknown)."""
        self.margin.missed(now, budget_s, ratio)

    def check_admission(
        self,
        now: float,
        deadline: float,
        items: int,
        ahead_requests: int = 0,
        ahead_items: int = 0,
        ready_at: float | None = None,
        level: int = 1,
    ) -> float | None:
        """Raise what :meth:`submit` would refuse a request of ``items`` with.

        ``ahead_*`` count requests not queued yet that will be, and
        ``ready_at`` is when this one can join the queue (both given by
        :meth:`reserve`): a request that would only be refused after the work
        ahead of the queue is refused before it.
        Returns when the measured latencies say it will be done, before any
        margin (None while nothing is measured): what its real time is
        compared with, to tell the margin how far predictions fall short.
        """
        if self._closed:
            raise Unavailable(f"model '{self.label}' is unloading")
        queued = self._queued_requests + ahead_requests
        if queued >= self.max_queue_size:
            self._stats.rejected["queue_full"] += 1
            # Sent, though not admitted: an arrival all the same (see Echoes).
            self._echoes.arrived(now, items)
            raise QueueFull(
                f"model '{self.label}' queue is full: {queued} requests waiting "
                f"(max_queue_size {self.max_queue_size}); retry later"
            )
        if self._level_requests[level] >= self._level_limit[level]:
            self._stats.rejected["queue_full"] += 1
            self._echoes.arrived(now, items)
            raise QueueFull(
                f"model '{self.label}' queue of priority level {level} is full: "
                f"{self._level_requests[level]} requests waiting (its max_queue_size); retry later"
            )
        if deadline <= now:
            raise DeadlineExceeded(f"request deadline already passed on arrival at '{self.label}'")
        if not self._running and self._queued_requests + ahead_requests == 0:
            # Idle: a busy spell starts with this request. After a rest at least as
            # long as its budget, nothing admitted before is still waiting, and the
            # spell starts fresh (a burst at an idle or lightly loaded server); a
            # gap between the batches of an overload does not count.
            rested = now - self._quiet_since
            if rested >= deadline - now:
                self._fresh_until = deadline
            self.latency.relax(rested)
            self._quiet_since = now
        if not self.latency.known:
            return None
        # Promises are made on pessimistic latencies (see LatencyModel.high).
        high = self.latency.high
        start = now if ready_at is None else ready_at
        first_free = (
            start
            if self._own_free > 0 or not self._running
            else min(r.started + high(r.size) for r in self._running)
        )
        instances = self._pool.live
        device = self._device
        if device is not None:
            # The device runs the other models' work that comes first before this
            # model's; and no more of this model's batches at once than it has slots.
            first_free = max(first_free, start + device.ahead_s(self, start, level, deadline))
            instances = min(instances, device.slots)
        queued_items = self._items_up_to(level)
        fresh = now <= self._fresh_until
        # The next batch is cut by the earliest deadline among the queued and this
        # request: size the batches ahead by it (the queue's own evidence), not by a
        # guess at half the budget. In a fresh spell everything ahead came with this
        # request (a burst), and none has a deadline before the spell's first one.
        ahead_deadline = min(self._fresh_until, deadline) if fresh else deadline
        top = self._top()
        if top is not None:
            ahead_deadline = min(ahead_deadline, top.deadline)
        if ahead_requests and not fresh:  # reserved, so not in the heap: deadlines unknown
            ahead_deadline = min(ahead_deadline, start + (deadline - start) / 2)
        staged = self._staged
        if staged is not None and self._by_level:
            # It runs before anything queued now, as the batch it is: with levels its
            # requests may be a lower level's, whose deadlines say nothing of how
            # the batches behind it (this request's level first) are cut.
            first_free += high(staged.batch.size)
        elif staged is not None:  # it runs before anything queued now
            ahead_items += staged.batch.size
            ahead_deadline = min(ahead_deadline, staged.batch.earliest)
        finish = predicted_finish(
            start, queued_items + ahead_items, items, instances,
            first_free, self.limits, high, deadline, ahead_deadline,
        )  # fmt: skip
        predicted = finish
        # What recent misses say the prediction is short by (1.0 unless overloaded),
        # for a request that would wait with others in a lasting overload, where the
        # queue drains in smaller and slower batches than planned. Not for the first
        # of the next batch (nothing queued: it runs at once, or behind the running
        # batch): refused, it leaves the instance idle when that batch ends, and a
        # storm's clients, refused this way, had the model run batches of one with
        # idle gaps between; work-conserving admission takes it on the measured batch
        # times, whose jitter is in the pessimistic estimates. Nor one in a fresh
        # spell (a burst at a rested server: the queue ahead is only what came with
        # it, and the measured latencies are what will drain it): a server whose load
        # fell serves what it can, and so lowers the margin, instead of refusing on an
        # old factor.
        if queued_items + ahead_items > 0 and not fresh:
            finish = now + (finish - now) * self.margin.factor
        # The loop's own lag, once: the answer waits in it before it is written. The
        # wait before this handler ran is already spent from the deadline (it counts
        # from the request's first bytes).
        lag = self._lag.recent
        finish += lag
        if finish > deadline:
            self._stats.rejected["deadline_unmeetable"] += 1
            self._echoes.arrived(now, items)
            raise Unavailable(
                f"model '{self.label}' cannot meet the request's deadline: "
                f"{(deadline - now) * 1e3:.1f} ms left, but {queued} request(s) "
                f"ahead and the measured latencies predict {(finish - now) * 1e3:.1f} ms"
                + (f" (with the event loop's lag of {lag * 1e3:.1f} ms)" if lag > 1e-3 else "")
            )
        return predicted

    def forget(self, req: InferenceRequest) -> None:
        """The client went away: take ``req`` out of the queue, or out of the staged
        batch while no instance has taken it (its future is already done)."""
        if req.queued:
            self._unqueue(req)
            self._stats.cancelled += 1
            self._compact()
            return
        staged = self._staged
        if staged is None or req not in staged.batch.requests:
            return
        seen = staged.drop(req)
        if seen is Seen.TAKEN:
            return  # running: it ends with its batch, as in any running batch
        self._stats.cancelled += 1
        if seen is Seen.TAKEN_BACK:  # it was the last one in it
            self._unstage()

    def _unqueue(self, req: InferenceRequest) -> None:
        req.queued = False
        self._queued_requests -= 1
        self._queued_items -= req.batch_size
        self._level_requests[req.level] -= 1
        self._level_items[req.level] -= req.batch_size

    def _top(self) -> InferenceRequest | None:
        """The most urgent queued request (None: nothing queued).

        The heap keeps stale entries, requests no longer queued (a cancelled one
        is only marked, so that a cancellation costs no heap work), until they
        reach its top or :meth:`_compact` rebuilds it. Here they are dropped,
        and only here.
        """
        heap = self._heap
        while heap and not heap[0].queued:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _pop_top(self) -> InferenceRequest:
        """Take the request :meth:`_top` just returned out of the queue."""
        req = heapq.heappop(self._heap)
        self._unqueue(req)
        return req

    def _compact(self) -> None:
        # Stale entries (cancelled, or already dispatched behind a request that
        # still waits) are skipped lazily; rebuild when they dominate, so neither
        # a storm of cancellations nor one starved shape grows memory unbounded.
        limit = 2 * self._queued_requests + 64
        if len(self._heap) > limit:
            self._heap = [r for r in self._heap if r.queued]
            heapq.heapify(self._heap)
        if len(self._expiry) > limit:
            self._expiry = [e for e in self._expiry if e[2].queued and e[0] == e[2].deadline]
            heapq.heapify(self._expiry)
        if len(self._fifo) > limit:
            self._fifo = deque(r for r in self._fifo if r.queued)

    # --- deciding -------------------------------------------------------------

    def _pump(self) -> None:
        self._pump_soon = False
        # Requests come alone while a pump after arrivals finds only one: then one
        # that finds the model idle may take the fast path (_runs_now). Several
        # parsed in one pass of the loop batch together instead.
        if self._arrived:
            self._alone = self._arrived == 1
            self._arrived = 0
        now = self._clock()
        self._expire_queued(now)
        if self._staged is not None:
            self._restage(now)
        wake_at: float | None = None
        while self._queued_requests and (free := self._free) > 0:
            if self._shed_hopeless(now):
                continue  # the queue changed: look at it again
            top = self._top()
            if top is None:
                break
            view = QueueView(self._queued_items, self._oldest_arrival(), top.deadline)
            decision = plan(now, view, free, self.limits, self.latency.estimate,
                            self._rate.per_second(now), self._echoes.expected(now))  # fmt: skip
            if decision.take == 0:
                wake_at = decision.wake_at
                break
            self._dispatch(self._form(decision.take, now), now)
        device = self._device
        if device is not None:
            if self._queued_requests and wake_at is None and self._own_free > 0:
                device.want(self)  # a batch to run, and no slot: the device decides when
        elif (
            self._stager is not None
            and self._staged is None
            and self._queued_requests
            and self._free <= 0
            and self._pool.live > 0
            and self._stager.can_stage()
        ):
            self._stage(now)
        self._compact()
        if not self._running and not self._queued_requests:
            self._quiet_since = now
        self._arm_timer(wake_at)

    def _oldest_arrival(self) -> float:
        """When the oldest queued request arrived (the queue is not empty)."""
        fifo = self._fifo
        while not fifo[0].queued:
            fifo.popleft()
        return fifo[0].arrival

    def _first_free_at(self, now: float) -> float:
        """When the first busy instance is expected to be free (``now`` if overdue)."""
        return max(now, min((r.expected_end for r in self._running), default=now))

    def _echo_at(self, start: float) -> Echo | None:
        """What the batch expected to end first (at ``start``) will bring back."""
        first = min(self._running, key=lambda r: r.expected_end, default=None)
        return None if first is None else self._echoes.after(start, first.size)

    def _stage(self, now: float) -> None:
        """Every instance is busy: stage the batch the policy would cut the moment
        the first one frees up (its expected end), if it would cut one then."""
        assert self._stager is not None
        top = self._top()
        assert top is not None  # called with requests queued
        start = self._first_free_at(now)
        view = QueueView(self._queued_items, self._oldest_arrival(), top.deadline)
        decision = plan(start, view, 1, self.limits, self.latency.estimate,
                        self._rate.per_second(now), self._echo_at(start))  # fmt: skip
        if decision.take == 0:
            return  # it would wait for more then: the batch is cut when it frees up
        picked = self._form(decision.take, now)
        size = sum(r.batch_size for r in picked)
        running = _Running(picked, size, now, start + self.latency.estimate(size), self._on_done)
        running.timer = self._loop.call_later(running.earliest - now, self._expire_running, running)
        self._staged = StagedBatch(running, self._stager.stage(running))

    def _restage(self, now: float) -> None:
        """Bring the staged batch up to date (:meth:`StagedBatch.refresh`): running
        already (an instance took it), grown from the queue, or taken back to be
        cut again."""
        staged = self._staged
        assert staged is not None
        running = staged.batch
        earliest = running.earliest

        def cut(top: InferenceRequest) -> int:
            """What the policy would cut from the staged requests and the queue
            together, for the moment the first busy instance frees up."""
            start = self._first_free_at(now)
            oldest = min(self._oldest_arrival(), *(r.arrival for r in running.requests))
            view = QueueView(running.size + self._queued_items, oldest, min(earliest, top.deadline))
            return plan(start, view, 1, self.limits, self.latency.estimate,
                        self._rate.per_second(now), self._echo_at(start)).take  # fmt: skip

        seen = staged.refresh(self._top, self._pop_top, cut)
        if seen is Seen.TAKEN:
            self._staged = None
            self._started_staged(running, staged.held_s)
        elif seen is Seen.TAKEN_BACK:
            self._unstage()
            self._requeue(running.requests)
        elif running.earliest < earliest:  # its guard goes off at the earliest deadline in it
            if running.timer is not None:
                running.timer.cancel()
            running.timer = self._loop.call_later(
                running.earliest - now, self._expire_running, running
            )

    def _unstage(self) -> None:
        """The staged batch was taken back: no batch is staged, and its deadline
        guard is off (its requests are the caller's to requeue or answer)."""
        staged = self._staged
        assert staged is not None
        self._staged = None
        if staged.batch.timer is not None:
            staged.batch.timer.cancel()

    def _requeue(self, requests: list[InferenceRequest]) -> None:
        """Put back the requests of a staged batch taken back (those still unanswered)."""
        back = [r for r in requests if not r.future.done()]
        for req in back:
            self._enqueue(req)
        # They are older than most of the queue: the FIFO is rebuilt in arrival order.
        self._fifo = deque(sorted((r for r in (*back, *self._fifo) if r.queued),
                                  key=lambda r: r.arrival))  # fmt: skip

    def _started_staged(self, running: _Running, held_s: float) -> None:
        """An instance took the staged ``running``, ``held_s`` after it was staged:
        it is a running batch now."""
        started = running.started + held_s
        running.started = started
        # Expected to end one estimate after it started, not after the prediction it
        # was staged on: chained predictions drift ahead with every batch that ends
        # early, and the next batch, staged for that later start, is cut by
        # deadlines it could in fact meet (a storm's thread row ran every batch
        # alone that way; bench/RESULTS-overload.md).
        running.expected_end = started + self.latency.estimate(running.size)
        self._note_queue_wait(running.requests, started)
        self._running.add(running)

    def _shed_hopeless(self, now: float) -> bool:
        """Answer the head of the queue now if it could only run in a batch less
        than a quarter as large as the queue allows; True if it did.

        Batches never run past their earliest deadline (see the policy). Under
        overload that alone spirals: the most urgent request has just enough
        time to run alone, so it does, while the others age and become the next
        most urgent, and a model that batches 16 in the time of 4 serves one at
        a time. A request that can only be saved that way is given up (504)
        so that the rest are served in time in batches worth running. A
        quarter, not a half: admission keeps the queue short, so a head short
        of time is mostly one slow batch's doing, and at a half one such batch
        had the heads behind it given up one after another (bursts of 10-19
        504s in the overload run, against 0-3 at a quarter).
        """
        if not self.latency.known:
            return False
        head = self._top()
        assert head is not None  # called with requests queued
        full = min(self._queued_items, self.limits.max_batch_size)
        estimate = self.latency.estimate
        if now + estimate(full) <= head.deadline:
            return False  # no deadline pressure: the common case, one estimate
        cap = deadline_cap(now, head.deadline, self.limits, estimate)
        if 4 * cap >= full:
            return False
        self._pop_top()
        self._time_out(head, now, head.deadline, (
            f"request given up after {(now - head.arrival) * 1e3:.1f} ms in the queue of "
            f"'{self.label}': {(head.deadline - now) * 1e3:.1f} ms left, enough only for a batch "
            f"of {cap} while {full} wait; the server is overloaded"
        ))  # fmt: skip
        return True

    def _expire_queued(self, now: float) -> None:
        if self._by_level:
            self._expire_by_deadline(now)
            return
        while (req := self._top()) is not None and req.deadline <= now:
            self._pop_top()
            self._time_out(req, now, now, (
                f"request timed out after {(now - req.arrival) * 1e3:.1f} ms waiting in the "
                f"queue of '{self.label}'"
            ))  # fmt: skip

    def _expire_by_deadline(self, now: float) -> None:
        """:meth:`_expire_queued` with levels: the queue's top is not the earliest
        deadline, so the requests past theirs are found in ``_expiry``. A level
        whose policy says DELAY keeps its request, demoted below every level, for
        as long again as its timeout."""
        expiry = self._expiry
        demoted = False
        while expiry and expiry[0][0] <= now:
            deadline, _, req = heapq.heappop(expiry)
            if not req.queued or deadline != req.deadline:
                continue  # stale: dispatched, cancelled, or demoted since
            self._unqueue(req)
            if req.level != self.delayed_level and self._delays[req.level]:
                req.level = self.delayed_level
                req.deadline = deadline + (deadline - req.arrival)
                self._enqueue(req)
                demoted = True
                continue
            self._time_out(req, now, now, (
                f"request timed out after {(now - req.arrival) * 1e3:.1f} ms waiting in the "
                f"queue of '{self.label}'"
            ))  # fmt: skip
        if demoted:  # its heap entry still sits at its old place: put it in order
            self._heap = [r for r in self._heap if r.queued]
            heapq.heapify(self._heap)

    def _time_out(self, req: InferenceRequest, now: float, until: float, message: str) -> None:
        """Answer ``req`` with a timeout (``message``), counted and told to the margin
        (its overrun measured ``until`` then)."""
        self._stats.timed_out += 1
        self.margin.missed(now, req.deadline - req.arrival, _overrun(req, until))
        _fail(req, DeadlineExceeded(message))

    def _form(self, take: int, now: float) -> list[InferenceRequest]:
        """Pop up to ``take`` items of one input shape, earliest deadline first."""
        heap, picked, aside = self._heap, [], []
        items, key = 0, None
        while items < take and (req := self._top()) is not None:
            if key is None:
                key = req.shape_key
            elif req.shape_key != key:
                aside.append(heapq.heappop(heap))  # other shapes wait for their own batch
                continue
            if picked and items + req.batch_size > take:
                break
            picked.append(self._pop_top())
            items += req.batch_size
        for req in aside:
            heapq.heappush(heap, req)
        return picked

    def _dispatch(self, picked: list[InferenceRequest], now: float) -> None:
        size = self._note_queue_wait(picked, now)
        running = _Running(picked, size, now, now + self.latency.estimate(size), self._on_done)
        running.timer = self._loop.call_later(running.earliest - now, self._expire_running, running)
        self._running.add(running)
        self._take_slot(running)
        self._pool.submit(running)

    def _take_slot(self, running: _Running) -> None:
        """On a shared device, ``running`` holds a slot until it ends."""
        device = self._device
        if device is not None:
            running.device = device
            running.slot = device.acquire(self.label, running.expected_end)

    def _note_queue_wait(self, picked: list[InferenceRequest], now: float) -> int:
        """Record the queue time of ``picked``, whose batch starts at ``now``; returns its size."""
        size = 0
        queue_ns = 0
        observe_queue = self._stats.queue_seconds.observe
        for req in picked:
            size += req.batch_size
            req.dispatched = now
            waited = now - req.arrival
            queue_ns += int(waited * 1e9)
            observe_queue(waited)
        self._stats.queue.add(queue_ns, len(picked))
        return size

    def _on_done(self, job: _Running) -> None:
        """A batch came back from its executor (called on the loop)."""
        self._answer(job)
        self._pump()

    def _answer(self, running: _Running) -> None:
        """Answer the requests of a batch its executor has run, and learn from it."""
        now = self._clock()
        staged = self._staged
        if staged is not None and staged.batch is running:  # ended before a pump saw it taken
            self._staged = None
            self._started_staged(running, staged.held_s)
        self._running.discard(running)
        if running.timer is not None:
            running.timer.cancel()
        if running.error is None:  # a failure's time (an instant refusal, say) says nothing
            self.latency.observe(running.size, now - running.started)
        answered = sum(r.batch_size for r in running.requests if not r.future.done())
        self._echoes.ended(now, answered, self.limits.max_delay)
        t0 = time.perf_counter_ns()
        outputs, requests, stats = running.outputs, running.requests, self._stats
        if outputs is None:
            error = InternalError(f"model '{self.label}' failed: {running.error}")
            error.__cause__ = running.error  # what the engine raised, for callers in this process
            log.warning("batch of %d on '%s' failed: %r", running.size, self.label, running.error)
            for req in requests:
                if _fail(req, error):
                    stats.fail.add(int((now - req.arrival) * 1e9))
        else:
            offset = served = 0
            worst = 0.0  # the largest time / predicted time among the served
            for req in requests:
                n = req.batch_size
                fut = req.future
                req.compute_ns = running.infer_ns
                if not fut.done():
                    # Views, not copies: each request gets its rows of the batch.
                    fut.set_result({k: v[offset : offset + n] for k, v in outputs.items()})
                    stats.success.add(int((now - req.arrival) * 1e9))
                    served += 1
                    if req.predicted > req.arrival:
                        worst = max(worst, (now - req.arrival) / (req.predicted - req.arrival))
                offset += n
            if served:
                self.margin.served(now, served, worst or None)
        stats.record_batch(running.size, len(requests), running.input_ns, running.infer_ns,
                           time.perf_counter_ns() - t0)  # fmt: skip
        if running.device is not None:
            # The slot goes to the most urgent batch at once, this model's next one
            # among the candidates (it waits for the slot like the others).
            device, running.device = running.device, None
            if self._queued_requests and device is self._device and self._own_free > 0:
                device.waits(self)
            device.release(running.slot, running.started, running.size)

    def _expire_running(self, running: _Running) -> None:
        """Deadline guard for a batch still in its executor: answer the expired now."""
        now = self._clock()
        later = None
        # (As far as the loop knows) no instance has started it yet.
        waiting = self._staged is not None and self._staged.batch is running
        for req in running.requests:
            if req.future.done():
                continue
            if req.deadline <= now:
                waited = f"request timed out after {(now - req.arrival) * 1e3:.1f} ms"
                if waiting:
                    message = f"{waited} waiting in the queue of '{self.label}'"
                else:
                    message = f"{waited}; the model '{self.label}' was still running its batch"
                self._time_out(req, now, now, message)
            else:
                later = req.deadline if later is None else min(later, req.deadline)
        running.timer = (
            None
            if later is None
            else self._loop.call_later(later - now, self._expire_running, running)
        )

    def _arm_timer(self, wake_at: float | None) -> None:
        at = wake_at
        if self._queued_requests:
            if self._by_level:
                expiry = self._expiry
                while expiry and (not expiry[0][2].queued or expiry[0][0] != expiry[0][2].deadline):
                    heapq.heappop(expiry)
                top = expiry[0][0] if expiry else math.inf
            else:
                head = self._top()
                top = head.deadline if head is not None else math.inf
            at = top if at is None else min(at, top)
        if at is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        if self._timer is not None:
            if self._timer_at == at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_later(max(0.0, at - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    # --- settings -------------------------------------------------------------

    def reconfigure(self, batching: BatchingConfig) -> None:
        """Take new batching settings in place (a config reload that needs no reload).

        ``max_batch_size`` cannot change here: the latency table and the
        engine's staging buffers are sized by it; nor can the priority levels,
        which order the queue (``batching_reconfigurable`` in runtimes.base says so). Queued requests stay; a
        smaller ``max_queue_size`` only refuses new ones until the queue drains.
        """
        if batching.max_batch_size != self.limits.max_batch_size:
            raise ValueError("max_batch_size changes need a new runtime")
        self.limits = BatchLimits.build(
            batching.max_batch_size, batching.max_delay_ms, batching.preferred_batch_sizes
        )
        self.max_queue_size = batching.max_queue_size
        if self._queued_requests and not self._pump_soon:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    # --- shutdown -------------------------------------------------------------

    def close(self) -> None:
        """Refuse new requests and answer every waiting one (queued, or in a staged
        batch no instance took) as unavailable."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._device is not None:
            self._device.leave(self)
            self._device = None
        error = Unavailable(f"model '{self.label}' is unloading")
        for req in self._heap:
            if req.queued:
                self._unqueue(req)
                _fail(req, error)
        staged = self._staged
        if staged is not None and staged.take_back():  # its requests were waiting
            self._unstage()
            for req in staged.batch.requests:
                _fail(req, error)
        self._heap.clear()
        self._fifo.clear()
        self._expiry.clear()


def _overrun(req: InferenceRequest, until: float) -> float | None:
    """How many times its predicted time ``req`` has taken by ``until`` (None: no prediction)."""
    if req.predicted <= req.arrival:
        return None
    return (until - req.arrival) / (req.predicted - req.arrival)


def _fail(req: InferenceRequest, error: Exception) -> bool:
    """Answer ``req`` with ``error`` unless it already has an answer."""
    if req.future.done():
        return False
    req.future.set_exception(error)
    return True
