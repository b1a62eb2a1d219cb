"""What the batcher measures: per-batch-size run times, learned from warm-up
and live batches; the arrivals (their rate, and the echo of batch ends: the
clients a batch's answers bring back); and the admission margin.

Layer: ``sched`` (pure: no asyncio; time comes in as arguments or from the
``clock`` a caller passes), called on the loop by :mod:`aserve.loop.batcher`;
the echo's forecast is a :class:`~aserve.sched.policy.Echo` for
:func:`~aserve.sched.policy.plan`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable

from aserve.sched.policy import Echo

# Idle time is applied to the estimates in steps of this many half-lives (a 1 %
# fade), see LatencyModel.relax.
_RELAX_STEP = 0.015


class LatencyModel:
    """Estimated seconds to run a batch of each size (1..max_batch_size).

    Each measured size keeps an exponentially weighted mean, so the estimate
    follows slow drifts (thermal, other load); one observation can move it by
    at most a factor of two, so a single outlier cannot make admission control
    refuse every request that follows.
    Unmeasured sizes are interpolated linearly between measured neighbours;
    above the largest measured size the per-item cost of that size is
    extrapolated (an upper bound for the usual affine cost curve), below the
    smallest the smallest's time is used. With nothing measured every size
    estimates 0.0 and callers treat the model as "unknown".

    Promises (admission) use :meth:`high`, the estimate times ``stretch``:
    how long the recent batches took against their estimates, the 90th
    percentile of the last ``window`` ratios (at least 1, at most
    ``max_stretch``). Evidence, not a model of the jitter: a request behind a
    running batch waits for two batches, and two batches each at their 90th
    percentile make about the 99th of their sum, which is what a promise of
    0.99 in time needs; a spread-based bound (mean plus twice the mean
    deviation, capped at 3x) said 3x for a storm's erratic batches whose
    slowest tenth ran 1.5-2x, and refused everything behind a running batch.

    What load teaches fades while the model is idle (:meth:`relax`): batches
    that ran slow because the machine was busy (a storm's refusals, other
    tenants) leave estimates and jitter that nothing corrects once the
    server, believing them, refuses everything and so runs no batch. So over
    idle time each estimate's excess over the lowest it (or any larger size)
    has been, and each recent ratio's excess over 1, halve every
    ``idle_half_life`` seconds; the next batches measure what is true now. A
    size first measured under load starts with a floor on the curve through
    the floors of the sizes measured before it (warm-up's), not at its own
    slow first time.
    """

    __slots__ = ("_alpha", "_floor", "_half_life", "_idle", "_max", "_max_stretch",
                 "_measured", "_ratios", "_sizes", "stretch")  # fmt: skip

    def __init__(
        self,
        max_batch_size: int,
        alpha: float = 0.2,
        idle_half_life: float = 1.0,
        window: int = 32,
        max_stretch: float = 3.0,
    ) -> None:
        self._max = max_batch_size
        self._alpha = alpha
        self._half_life = idle_half_life
        self._idle = 0.0  # idle seconds not applied yet (see relax)
        self._max_stretch = max_stretch
        self._floor: dict[int, float] = {}  # the lowest estimate each size has had
        self._measured: dict[int, float] = {}
        self._sizes: list[int] = []  # measured sizes, ascending
        # The last batches' times over their estimates (one series for all sizes: the
        # jitter comes from the machine, not the size), and their 90th percentile.
        self._ratios: deque[float] = deque(maxlen=window)
        self.stretch = 1.0

    @property
    def known(self) -> bool:
        return bool(self._measured)

    def observe(self, size: int, seconds: float) -> None:
        size = min(max(size, 1), self._max)
        old = self._measured.get(size)
        if old is not None and old > 0.0:
            # Against this size's own estimate only: a first run of a size compared
            # with one interpolated from its neighbours would count the curve as jitter.
            self._ratios.append(seconds / old)
            self._restretch()
        if old is None:
            # A size first run in a storm has only slow times of its own; the curve
            # through the sizes measured before says what it takes at its best.
            quiet = self._curve(self._floor, size) if self._sizes else seconds
            self._floor[size] = min(seconds, quiet)
            self._measured[size] = seconds
            bisect.insort(self._sizes, size)
        else:
            # One outlier (a huge input on a variable-shape model, a stall) may
            # at most double or halve an estimate; a lasting change still wins
            # within a few batches.
            new = old + self._alpha * (seconds - old)
            new = self._measured[size] = min(max(new, old / 2), old * 2)
            if new < self._floor[size]:
                self._floor[size] = new

    def relax(self, idle_seconds: float) -> None:
        """The model was idle for ``idle_seconds``: let what load taught fade by as much."""
        if idle_seconds <= 0.0 or not self._measured:
            return
        # A light load idles between every two requests, a fraction of a
        # millisecond each time: the gaps are summed and applied once they fade
        # the estimates by a percent (the fading composes: 0.5**a * 0.5**b is
        # 0.5**(a+b)), not each time, which cost every request a pass over the
        # sizes and the recent ratios.
        idle_seconds += self._idle
        if idle_seconds < _RELAX_STEP * self._half_life:
            self._idle = idle_seconds
            return
        self._idle = 0.0
        keep = 0.5 ** (idle_seconds / self._half_life)
        # Toward the lowest each size has been, or that any larger size has been: a
        # size first measured in a storm has only slow times of its own, but a batch
        # takes no longer than a larger one did at its best.
        low = math.inf
        for size in reversed(self._sizes):
            low = min(low, self._floor[size])
            value = self._measured[size]
            if value > low:
                self._measured[size] = low + (value - low) * keep
        if self._ratios:
            self._ratios = deque(
                (r if r <= 1.0 else 1.0 + (r - 1.0) * keep for r in self._ratios),
                maxlen=self._ratios.maxlen,
            )
            self._restretch()

    def _restretch(self) -> None:
        ratios = sorted(self._ratios)
        n = len(ratios)
        p90 = ratios[min(n - 1, (9 * n) // 10)]  # nearest rank; the largest while few
        self.stretch = min(max(p90, 1.0), self._max_stretch)

    def estimate(self, size: int) -> float:
        # Called on every admission and every batching decision: a dict hit,
        # else one bisect over the few measured sizes. Nothing is rebuilt.
        measured = self._measured
        hit = measured.get(size)
        if hit is not None:
            return hit
        if not self._sizes:
            return 0.0
        return self._curve(measured, size)

    def _curve(self, measured: dict[int, float], size: int) -> float:
        """``size`` on the curve through ``measured`` (the estimates, or the floors)
        at the measured sizes, as the class docstring says; at least one is measured."""
        sizes = self._sizes
        size = min(max(size, 1), self._max)
        i = bisect.bisect_left(sizes, size)
        if i == 0:
            return measured[sizes[0]]
        if i == len(sizes):
            top = sizes[-1]
            return measured[top] * size / top
        lo, hi = sizes[i - 1], sizes[i]
        return measured[lo] + (size - lo) / (hi - lo) * (measured[hi] - measured[lo])

    def high(self, size: int) -> float:
        """A pessimistic estimate: what the slowest tenth of recent batches took
        against their estimates, for promises (admission), where a batch that
        runs long breaks one."""
        return self.estimate(size) * self.stretch

    def snapshot(self) -> dict[int, float]:
        """Measured sizes and their estimates, for statistics and logs."""
        return dict(sorted(self._measured.items()))


class ArrivalRate:
    """Requests per second arriving at one model, as an EWMA of the gaps.

    An idle spell makes the next gap long, so the rate drops at once and the
    batcher stops waiting for company that is not coming.
    """

    __slots__ = ("_gap", "_last")

    def __init__(self) -> None:
        self._last: float | None = None
        self._gap = math.inf

    def observe(self, now: float) -> None:
        if self._last is not None:
            gap = now - self._last
            if math.isinf(self._gap) or gap > 4 * self._gap:
                # A first gap, or one long pause that the old burst must not average away.
                self._gap = gap
            else:
                self._gap += 0.1 * (gap - self._gap)
        self._last = now

    def per_second(self, now: float) -> float:
        if self._last is None or math.isinf(self._gap):
            return 0.0
        # Silence since the last arrival also counts as a gap in progress.
        gap = max(self._gap, now - self._last)
        return 1.0 / gap if gap > 0 else math.inf


# Below this many answered items coming back per item, the excesses are taken
# for chance (an open loop's windows differ by a few arrivals either way).
_MIN_RATIO = 0.5


class Echoes:
    """The echo of batch ends in the arrivals of one model (the arrivals that a
    batch's answers bring back: a closed loop's), and its forecast.

    Clients that send their next request when the last is answered (a closed
    loop: a benchmark's connections, a pipeline's workers) come back within a
    short return time of each batch's end. The mean arrival rate cannot see
    this: with ``c`` such clients it averages their requests over the whole
    cycle, and the batcher runs the requests that queued behind the last batch
    while the ones just answered are about to return.

    So after each batch end ``e`` that answered ``k`` items the arrivals of a
    window are counted: ``(e, e + len]``, ``len`` = twice the batcher's
    ``max_delay``, or up to the next batch end if that comes first. Twice: an
    echo is worth holding requests for when its first requests come within
    ``max_delay`` of the end (the requests queued behind the batch are held from
    the end), or, with nothing queued then, when the rest follow within
    ``max_delay`` of the first (held from their arrival); a measure over
    ``max_delay`` alone missed a loaded machine's echo whose first requests came
    5-8 ms after the end, with ``max_delay`` at 5 ms. What arrives regardless
    of batch ends (an open loop's arrivals, a steady background) is subtracted:
    the arrivals of the same length just before ``e`` (as many, in the mean, as
    after it), leaving out the window of the end before (what it brought back
    is no background: at 16 clients in turns of 1 and 15, the 15 came back
    while the batch of 1 ran, and the end of that batch seemed to bring back
    -14), the rest scaled to ``len``; where nothing is left (batches shorter
    than the window), the whole length before ``e``. The arrivals are the
    requests clients send, those that admission control refuses included: under
    overload the admitted ones come in a wave after each end (the queue ahead of
    them is gone), admission's echo, not the clients', while what they send
    comes regardless of the ends. Two moving means follow the windows:
    ``ratio``, that excess over ``k`` (about 1 in a closed loop, about 0 in an
    open one), and the return time, the offset of the window's last arrival (with a mean deviation, as TCP follows its
    round trip). A forecast says how many more items the last batch end is
    expected to bring (``round(k * ratio)`` less those arrived since it), when
    they are due (the mean return time) and until when they may still come
    (the mean plus four deviations, as TCP's retransmission timeout): only
    while the window is open, and only when the windows show that most of a
    batch comes back (``ratio >= 1/2``); chance excesses of an open loop do not
    make a forecast."""

    __slots__ = ("_after", "_alpha", "_before", "_before_s", "_closed_at", "_dev", "_end",
                 "_items", "_lag", "_last", "_open", "_times", "_window", "ratio")  # fmt: skip

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self.ratio = 0.0  # items arriving after an end beyond those before it, per answered item
        self._lag = math.nan  # mean return time: the last echo arrival's offset from the end
        self._dev = 0.0  # its mean deviation
        # Arrival times of the last two windows, for the count before an end.
        self._times: deque[float] = deque()
        self._open = False  # a window after an end is counting
        self._end = 0.0
        self._items = 0  # answered by that end
        self._window = 0.0
        self._before = 0  # arrivals before the end, in the last window's length (less the
        self._before_s = 0.0  # end before's window), and that length (0: nothing was left)
        self._closed_at = -math.inf  # where the end before's window closed
        self._after = 0  # arrivals since the end, within the window
        self._last = 0.0  # the offset of the last of them

    def arrived(self, now: float, items: int = 1) -> None:
        """``items`` arrived at ``now``."""
        if self._open:
            if now <= self._end + self._window:
                if now > self._end:
                    self._after += items
                    self._last = now - self._end
            else:
                self._close(self._window)
        if self._window > 0.0:
            times = self._times
            if times and now < times[-1]:  # a refusal timed at its arrival, a little earlier
                for _ in range(items):
                    bisect.insort(times, now)
            else:
                times.append(now)
                if items > 1:
                    times.extend([now] * (items - 1))
            horizon = now - 2.0 * self._window
            while times[0] < horizon:
                times.popleft()

    def ended(self, now: float, items: int, max_delay: float) -> None:
        """A batch ended at ``now`` and answered ``items``; ``max_delay``: the
        longest a request may be held for company."""
        if self._open:
            self._close(min(self._window, now - self._end))
        self._window = window = 2.0 * max_delay
        if window <= 0.0 or items <= 0:
            self._times.clear()
            return
        self._open = True
        self._end = now
        self._items = items
        self._after = 0
        start = max(now - window, self._closed_at)
        self._before_s = max(now - start, 0.0)
        self._before = self._count(start, now) if self._before_s > 0.0 else 0

    def _count(self, start: float, end: float) -> int:
        """Arrivals in ``(start, end]`` (recent ones only: ``end`` is the last end)."""
        times = self._times  # ascending: a bisection, not a walk over a busy window
        return bisect.bisect_right(times, end) - bisect.bisect_right(times, start)

    def _close(self, length: float) -> None:
        """The window after the last end closes after ``length``: learn from it."""
        self._open = False
        end = self._end
        self._closed_at = end + length
        if self._before_s > 0.0:
            background = self._before * length / self._before_s
        else:
            background = self._count(end - length, end)
        excess = self._after - background
        a = self._alpha
        self.ratio += a * (min(max(excess / self._items, -2.0), 2.0) - self.ratio)
        if excess >= 1:
            lag = self._last
            if math.isnan(self._lag):
                self._lag, self._dev = lag, lag / 2
            else:
                self._dev += a * (abs(lag - self._lag) - self._dev)
                self._lag += a * (lag - self._lag)

    def expected(self, now: float) -> Echo | None:
        """What the last batch end is still expected to bring at ``now`` (None: nothing)."""
        if not self._open:
            return None
        if now > self._end + self._window:
            self._close(self._window)
            return None
        return self._forecast(self._end, self._items, self._after)

    def after(self, end: float, items: int) -> Echo | None:
        """What a batch expected to end at ``end``, answering ``items``, will bring."""
        if self._window <= 0.0:
            return None
        return self._forecast(end, items, 0)

    def _forecast(self, end: float, items: int, arrived: int) -> Echo | None:
        if self.ratio < _MIN_RATIO or math.isnan(self._lag):
            return None
        more = round(items * self.ratio) - arrived
        if more <= 0:
            return None
        return Echo(more, end + self._lag, end + self._lag + 4.0 * self._dev, end)


class AdmissionMargin:
    """How much longer than predicted admission control assumes a request takes.

    The predictions come from mean batch latencies and a queue drained in
    ideal batches; under overload the truth varies around them (batches run
    slower while the machine is busy, the queue drains in smaller batches
    than planned), and a request admitted on a prediction that was a little
    short misses its deadline. So admission multiplies each prediction by
    ``factor``, steered by what happens to the admitted: a miss raises it by
    ``raise_by``, every request served in time lowers it by ``lower_by``,
    never below 1.

    Misses come in bursts (one slow batch fails all of its requests, and
    every request admitted before the raise was admitted on the old factor),
    so after a raise the next one waits ``hold`` seconds: the missed
    request's own time budget, within which those admitted before it are
    answered (as TCP cuts its window at most once per round trip).

    What was learnt is forgotten with time too, not only with successes: the
    excess over 1 halves every ``min_half_life`` seconds (or four of the last
    miss's budgets, if longer, so that a model with long deadlines keeps it
    between the misses that steer it). A server that refuses most of what
    comes serves few and would otherwise keep an overload's margin for
    minutes after it ended. Not faster: under a lasting overload each raise
    costs a few misses, and a margin that fades within seconds must be
    raised, so missed, that much more often. And the margin never exceeds
    the evidence: ``observe`` is told, for each answered or missed request,
    how its real time compared with its prediction, and the factor stays at
    or under the largest such ratio seen lately (forgotten at the same pace,
    capped at ``ceiling``; a miss, whose real time is only known to exceed
    its budget, counts one raise above its ratio), so a burst of misses
    cannot stretch predictions much further than any request has actually
    overrun them.

    Times are the caller's clock (``clock``, the batcher's).
    """

    __slots__ = ("_at", "_ceiling", "_clock", "_down", "_evidence", "_excess", "_half_life",
                 "_hold_until", "_min_half_life", "_up")  # fmt: skip

    def __init__(
        self,
        raise_by: float = 0.25,
        lower_by: float = 0.0002,
        ceiling: float = 4.0,
        min_half_life: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._up = 1.0 + raise_by
        self._down = 1.0 - lower_by
        self._ceiling = ceiling
        self._min_half_life = min_half_life
        self._half_life = min_half_life
        self._clock = clock
        self._hold_until = -math.inf
        self._excess = 0.0  # factor - 1, as of ``_at``
        self._evidence = 0.0  # the largest overrun ratio seen lately, less 1, as of ``_at``
        self._at = clock()

    def _decay(self, now: float) -> None:
        dt = now - self._at
        if dt > 0:
            if self._excess > 0.0 or self._evidence > 0.0:
                keep = 0.5 ** (dt / self._half_life)
                self._excess *= keep
                self._evidence *= keep
            self._at = now

    @property
    def factor(self) -> float:
        if self._excess == 0.0:
            return 1.0  # the common case: nothing learnt, no clock read
        self._decay(self._clock())
        return 1.0 + self._excess

    @factor.setter
    def factor(self, value: float) -> None:
        """Set the factor now (tests, and an operator's reset), as if evidence showed it."""
        now = self._clock()
        self._decay(now)
        self._excess = max(min(value, self._ceiling) - 1.0, 0.0)
        self._evidence = max(self._evidence, self._excess)

    def observe(self, now: float, ratio: float) -> None:
        """A request took ``ratio`` times its predicted time (a miss: at least)."""
        over = min(ratio, self._ceiling) - 1.0
        if over > self._evidence:
            self._decay(now)
            self._evidence = max(self._evidence, over)

    def missed(self, now: float, hold: float, ratio: float | None = None) -> None:
        """An admitted request missed its deadline; ``ratio`` as for :meth:`observe`.

        A miss's ratio is only a lower bound (its time is cut at its deadline, or
        taken when the answer was already too late), so it justifies one raise
        beyond it.
        """
        if ratio is not None:
            self.observe(now, ratio * self._up)
        if now < self._hold_until:
            return
        self._decay(now)
        self._half_life = max(self._min_half_life, 4.0 * hold)
        raised = (1.0 + self._excess) * self._up - 1.0
        self._excess = min(raised, self._evidence)
        self._hold_until = now + hold

    def served(self, now: float, count: int = 1, ratio: float | None = None) -> None:
        """``count`` requests were served in time, the slowest ``ratio`` of its prediction."""
        if ratio is not None:
            self.observe(now, ratio)
        if self._excess > 0.0:
            self._decay(now)
            self._excess = (1.0 + self._excess) * self._down**count - 1.0
            if self._excess < 0.0:
                self._excess = 0.0
