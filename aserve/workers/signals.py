"""The process's signals, seen by a thread of its own (layer: workers).

asyncio's signal handlers run on the loop, so a loop that never gets back to
its selector never sees SIGTERM: a model's forward that never returns while
it runs inline on the loop (a tiny CPU batch, in C code that lets the GIL
go) kept a server alive through every signal but SIGKILL. So the server
takes SIGINT, SIGTERM and SIGHUP itself. Python's C-level handler writes the
number of every signal to a pipe (``signal.set_wakeup_fd``) the moment it
arrives, whatever the loop is doing; a daemon thread reading that pipe posts
each signal to the loop (through :mod:`.handoff`) and, for a stop signal,
calls the stop's own hook on the spot, from that thread: the first arms the
stop's deadline, a second ends the process (see :mod:`.last_resort`). Those
need no loop, so they hold while it is stuck.

A thread stuck in C code that keeps the GIL is beyond this (no Python runs
anywhere then); only a signal the kernel acts on ends such a process.

:meth:`SignalWatch.start` and :meth:`SignalWatch.stop` run on the main
thread, the only one that may install signal handlers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from aserve.workers.handoff import post_threadsafe

log = logging.getLogger("aserve.server")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WATCHED = (*STOP_SIGNALS, signal.SIGHUP)
_WATCHED_NUMBERS = frozenset(int(sig) for sig in WATCHED)


def _noted(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing; the pipe carries the signal (and
    replacing the default keeps SIGTERM from killing the process outright)."""


class SignalWatch:
    """SIGINT, SIGTERM and SIGHUP for a server, from :meth:`start` until :meth:`stop`.

    ``on_signal(sig)`` runs on ``loop`` for every signal. ``on_stop_threadsafe(sig, n)``
    runs on the watching thread for the ``n``-th stop signal (SIGINT or SIGTERM),
    before ``on_signal`` is posted; it must not need the loop.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_signal: Callable[[signal.Signals], None],
        on_stop_threadsafe: Callable[[signal.Signals, int], None],
    ) -> None:
        self._loop = loop
        self._on_signal = on_signal
        self._on_stop_threadsafe = on_stop_threadsafe
        self._stops = 0
        self._write_fd = -1
        self._old_fd = -1
        self._old_handlers: dict[signal.Signals, Any] = {}

    def start(self) -> None:
        """Install the handlers and start watching (main thread)."""
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        for sig in WATCHED:
            self._old_handlers[sig] = signal.signal(sig, _noted)
        # Before any byte can arrive: a full pipe drops signals rather than warn.
        self._old_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(
            target=self._watch_threadsafe, args=(read_fd,), name="aserve-signals", daemon=True
        ).start()

    def stop(self) -> None:
        """Put back what was there before (main thread); the watching thread ends."""
        if self._write_fd < 0:
            return
        signal.set_wakeup_fd(self._old_fd)  # first: no signal is written to a closed pipe
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the reader sees the end of the pipe
        self._write_fd = -1

    def _watch_threadsafe(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                for number in data:
                    # Any signal with a Python handler is written here; ours only.
                    if number in _WATCHED_NUMBERS:
                        self._dispatch_threadsafe(signal.Signals(number))
        finally:
            os.close(read_fd)

    def _dispatch_threadsafe(self, sig: signal.Signals) -> None:
        if sig in STOP_SIGNALS:
            self._stops += 1  # only this thread counts
            self._on_stop_threadsafe(sig, self._stops)
        post_threadsafe(self._loop, self._on_signal, sig)
