"""The arrivals that a batch's answers bring back (a closed loop's echo).

Layer: ``sched`` (pure: no asyncio; the times are the caller's clock, passed
in), called on the loop by :mod:`aserve.loop.batcher` for every arrival and
every batch end; the forecast it gives is a :class:`~aserve.sched.policy.Echo`
for :func:`~aserve.sched.policy.plan`.

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
comes regardless of the ends. Two
moving means follow the windows: ``ratio``, that excess over ``k`` (about 1
in a closed loop, about 0 in an open one), and the return time, the offset
of the window's last arrival (with a mean deviation, as TCP follows its
round trip). A forecast says how many more items the last batch end is
expected to bring (``round(k * ratio)`` less those arrived since it), when
they are due (the mean return time) and until when they may still come
(the mean plus four deviations, as TCP's retransmission timeout): only
while the window is open, and only when the windows show that most of a
batch comes back (``ratio >= 1/2``); chance excesses of an open loop do not
make a forecast.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from aserve.sched.policy import Echo

# Below this many answered items coming back per item, the excesses are taken
# for chance (an open loop's windows differ by a few arrivals either way).
_MIN_RATIO = 0.5


class Echoes:
    """The echo of batch ends in the arrivals of one model, and its forecast."""

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
