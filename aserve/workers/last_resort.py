"""The last resort of a stop: the process ends by a deadline, whatever the loop is doing.

Layer: ``workers``. :class:`StopDeadline` is armed on the loop when the
server begins to stop; its countdown runs on a daemon thread of its own, so
it fires even while the loop waits on something that never ends (a thread
stuck in a model that the loop's default executor would join, a hung
unload). Then, and on a second SIGTERM, :func:`exit_now` kills the child
processes (a worker stuck in a ``forward`` does not read the pipe whose end
tells it to exit), removes what the server registered, flushes the logs and
calls ``os._exit(1)``: ``sys.exit`` would wait for the very threads that
keep the process from ending.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("aserve.server")

EXIT_FORCED = 1  # the status of a process that had to be ended this way


class StopDeadline:
    """Ends the process ``within_s`` after :meth:`arm`, unless it has ended by then.

    ``cleanup`` runs before the exit (on the countdown's thread or the loop):
    it must not block and must not need the loop.
    """

    def __init__(self, cleanup: Callable[[], None]) -> None:
        self._cleanup = cleanup
        self._armed = False
        self._arming = threading.Lock()  # armed from the loop and the signal thread
        self._done = threading.Event()

    def arm(self, within_s: float, what: str) -> None:
        """Start the countdown (the first call only; ``what`` names the bound in the log).
        Safe to call from any thread."""
        with self._arming:
            if self._armed:
                return
            self._armed = True
        threading.Thread(
            target=self._count_down_threadsafe,
            args=(within_s, what),
            name="aserve-stop-deadline",
            daemon=True,
        ).start()

    def disarm(self) -> None:
        """The process is about to end by itself."""
        self._done.set()

    def exit_now(self, reason: str) -> NoReturn:
        """Kill the child processes, clean up, flush the logs, ``os._exit(1)``."""
        exit_now(reason, self._cleanup)

    def _count_down_threadsafe(self, within_s: float, what: str) -> None:
        if self._done.wait(within_s):
            return
        self.exit_now(f"the server did not stop within {within_s:g} s ({what})")


def exit_now(reason: str, cleanup: Callable[[], None] | None = None) -> NoReturn:
    """End the process at once, with :data:`EXIT_FORCED`, after what cannot wait."""
    log.error("%s: exiting now (status %d)", reason, EXIT_FORCED)
    try:
        for child in multiprocessing.active_children():
            child.kill()  # SIGKILL: a worker stuck in a model ignores the rest
    except Exception:  # the set of children changed under us: the kernel reaps them
        log.exception("killing the child processes failed")
    if cleanup is not None:
        try:
            cleanup()
        except Exception:
            log.exception("cleaning up before the exit failed")
    for stream in (*(getattr(h, "stream", None) for h in logging.getLogger().handlers),
                   sys.stdout, sys.stderr):  # fmt: skip
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # nothing more can be said
            pass
    os._exit(EXIT_FORCED)
