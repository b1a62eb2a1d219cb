"""How late the event loop runs its callbacks: time an answer spends unseen.

Under a storm of requests the loop itself becomes a queue: a request waits
in it before its handler runs (its client's clock is already running) and
its answer waits again before it is written. Neither wait is in the
batcher's view of a request, which starts at the handler and ends when the
result is set, so admission that ignores them promises answers that reach
their clients late. :class:`LoopLag` measures the wait with a timer that
asks to run every ``interval`` seconds and records how late it ran; the
batcher adds the recent lag to its predictions once, for the answer's wait:
the request's own wait before its handler ran is over by the time admission
looks at it, and its deadline starts at the handler.

``recent`` moves toward each tick's lag, fast when it rises (``rise``) and
slower when it falls (``fall``): one pause (a garbage collection, a burst's
own parsing) counts for a fraction of itself and is forgotten within a
fraction of a second, while a lasting lag is counted within a few ticks. One sampler runs per
event loop, shared by every model on it; ticking costs about as much as
answering one health probe every ``interval``.

Each tick also closes a window of :attr:`LoopLag.stalls`
(:mod:`aserve.obs.loop_stalls`): of the same lateness, the part that work
of this process explains, as opposed to a machine that gave the loop no
CPU. Admission wants the wall time above (what clients wait, whatever the
cause); the server exports the other, and the tests assert on it.

Layer: ``loop``; runs on the event loop (its tick is a loop timer).
"""

from __future__ import annotations

import asyncio
import time
import weakref

from aserve.obs.loop_stalls import LoopStalls

_SAMPLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = (
    weakref.WeakKeyDictionary()
)


class LoopLag:
    __slots__ = ("_due", "_fall", "_interval", "_loop", "_rise", "recent", "stalls")

    def __init__(self, interval: float = 0.02, rise: float = 0.3, fall: float = 0.1) -> None:
        self._interval = interval
        self._rise = rise
        self._fall = fall
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self.recent = 0.0  # seconds
        self.stalls = LoopStalls()  # windows from one tick to the next, once started

    def observe(self, lag: float) -> None:
        """One tick ran ``lag`` seconds late."""
        step = self._rise if lag >= self.recent else self._fall
        self.recent += step * (lag - self.recent)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due = time.monotonic() + self._interval
        self.stalls.start(self._due)
        loop.call_later(self._interval, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        self.observe(max(now - self._due, 0.0))
        if self._loop is not None and not self._loop.is_closed():
            self._due = now + self._interval
            self.stalls.close_window(self._due)
            self._loop.call_later(self._interval, self._tick)

    @classmethod
    def of_running_loop(cls) -> LoopLag:
        """The sampler of the running loop, started on first use."""
        loop = asyncio.get_running_loop()
        lag = _SAMPLERS.get(loop)
        if lag is None:
            lag = _SAMPLERS[loop] = cls()
            lag.start(loop)
        return lag
