"""A log line that a storm cannot multiply (on the loop, or any one thread).

Things a client can cause without credentials (junk credentials, sockets that
never send a request, a descriptor table run dry) must not write a line per
event: 1,300 unauthenticated requests once wrote 944 KB of tracebacks. A
:class:`Throttled` writes the first event at once, then at most one line per
``interval_s`` with how many it left out meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Throttled:
    """One rate-limited log line for one kind of event."""

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval_s = interval_s
        self._clock = clock
        self._next = -float("inf")
        self.suppressed = 0  # events not logged since the last line

    def event(self, msg: str, *args: object) -> bool:
        """Count one event; log ``msg % args`` unless a line went out within
        the interval (then only count it). True when it logged."""
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self._interval_s
        if self.suppressed:
            msg += " (and %d more like it since the last such line)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.log(self._level, msg, *args)
        return True
