"""How long the event loop was held by work: a stall that a busy machine cannot fake.

:class:`aserve.loop.loop_lag.LoopLag` asks the loop to run a timer every 20 ms
and measures, in wall time, how late it runs: what a client waits. Lateness
has two kinds of cause. Work of this process: a callback computing on the
loop's thread, or another thread keeping the GIL through one long C call
while the loop waits for it. And the machine: the loop's thread waiting for
a CPU that other processes hold, or the whole process stopped (SIGSTOP, a
frozen container). "Does this input stall the loop?" asks about the first
alone; on a machine that other tenants oversubscribe the second grows
without limit while the server does nothing wrong.

:func:`held_s` takes the clocks at both ends of a window (from one tick of
the timer to the next) and counts, of the window's lateness, only work:

- the loop thread's CPU time (``time.thread_time``);
- the time the loop thread was blocked (not running, and not waiting for a
  CPU: the kernel's run-queue wait, ``/proc/self/task/<tid>/schedstat``, is
  taken off), up to the CPU time the process's other threads spent in the
  window: while a thread keeps the GIL it computes, while a process is
  stopped nothing does;

less the time the loop could spend idle before the timer was due. Where the
kernel does not report the run-queue wait (not Linux), only the loop
thread's CPU time counts. Not counted: a loop blocked in a system call (a
sleep, a slow disk) while no other thread computes. The histogram is
exported as ``aserve_loop_stall_seconds`` (:mod:`aserve.obs.loop_stall_metrics`);
the test suite's stall watchdog (``tests/stall_watch.py``) asserts on it.

Layer: ``obs``; the readings are taken on the loop's thread (the timer's
tick, and a scrape, which closes the window it falls in first). Imports no
Prometheus: ``aserve.Batched`` ticks it too.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

from aserve.obs.stats import Histogram

# A window's held time is mostly 0; a stall worth a look starts near 10 ms.
STALL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class Clocks(NamedTuple):
    """One reading, taken on the loop's thread; all in seconds."""

    wall_s: float  # time.monotonic()
    cpu_s: float  # the loop thread's CPU time
    process_cpu_s: float  # every thread's of this process
    queued_s: float | None  # the loop thread's total run-queue wait; None: not reported


def held_s(before: Clocks, after: Clocks, due_s: float) -> float:
    """Of the lateness between two readings, for a timer due at ``due_s``, the
    part this process's work explains (see the module docstring).

    ``free``, the time before the timer was due, is what the loop may spend
    idle (blocked in its selector) or at work without holding the timer; it
    is taken off once, so a loop busy all of its 20 ms but on time counts 0.
    """
    late = after.wall_s - max(due_s, before.wall_s)
    if late <= 0.0:
        return 0.0
    free = max(0.0, due_s - before.wall_s)
    cpu = after.cpu_s - before.cpu_s
    work = cpu
    if before.queued_s is not None and after.queued_s is not None:
        queued = after.queued_s - before.queued_s
        blocked = (after.wall_s - before.wall_s) - cpu - queued
        others = (after.process_cpu_s - before.process_cpu_s) - cpu
        work += min(max(blocked, 0.0), max(others, 0.0))
    return min(max(work - free, 0.0), late)


class _RunQueueWait:
    """The calling thread's total run-queue wait, from the kernel's schedstat
    (opened on that thread, read with one ``pread`` a tick)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open(
                f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY
            )
        except OSError:  # not Linux, or no schedstat: the loop thread's CPU time alone counts
            return
        weakref.finalize(self, os.close, self._fd)
        if self.read() is None:
            self._fd = None

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None


def _reader() -> Callable[[], Clocks]:
    """Read the clocks of the calling thread (which must then be the loop's)."""
    queued = _RunQueueWait()
    monotonic, thread_time, process_time = time.monotonic, time.thread_time, time.process_time

    def read() -> Clocks:
        return Clocks(monotonic(), thread_time(), process_time(), queued.read())

    return read


class LoopStalls:
    """The held time of each window, in a histogram.

    :meth:`start` and :meth:`close_window` run on the loop's thread; a reader
    there (:meth:`read`, a scrape) closes the window it falls in first, so a
    stall that ended before the scrape was answered is in it.
    """

    def __init__(self) -> None:
        self.histogram = Histogram(STALL_BUCKETS_S)
        self._read: Callable[[], Clocks] | None = None
        self._thread = 0
        self._last: Clocks | None = None
        self._due_s = 0.0

    def start(self, due_s: float) -> None:
        """Begin the first window, whose timer is due at ``due_s`` (monotonic)."""
        self._read = _reader()
        self._thread = threading.get_ident()
        self._last = self._read()
        self._due_s = due_s

    def close_window(self, next_due_s: float | None = None) -> None:
        """Observe the window that ends now; the next one's timer is due at
        ``next_due_s`` (None: the same timer, not run yet)."""
        if self._read is None or self._last is None:
            return
        now = self._read()
        self.histogram.observe(held_s(self._last, now, self._due_s))
        self._last = now
        if next_due_s is not None:
            self._due_s = next_due_s

    def read(self) -> Histogram:
        """The histogram, with the window now open closed first when called on
        the loop's thread (elsewhere: as the last tick left it)."""
        if threading.get_ident() == self._thread:
            self.close_window()
        return self.histogram
