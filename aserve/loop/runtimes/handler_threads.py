"""What runs on a handler model's own threads, not on the loop.

Layer: loop (the package), but none of this runs on the event loop: a
:class:`~aserve.loop.runtimes.handler.HandlerRuntime` hands these functions to
its thread pool (``loop.run_in_executor``), and they run the user's
``preprocess``/``postprocess`` there. They touch no asyncio object; their
results travel back through the executor's future.

A decoupled model's generator (:func:`stream_threadsafe`) sends its responses
back through :func:`aserve.workers.handoff.post_threadsafe`, one at a time,
and learns of a client that went from a ``threading.Event``.

One value crosses the boundary without a future: :class:`TimedStage` learns
how long a stage takes, written by the handler threads (several may add at
once) and read by the loop for its backlog estimate. No lock: each float
store is atomic under the GIL, and an estimate off by one sample is harmless.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from aserve.engines.python_handler import HandlerRequest, raw_answer


class Spread:
    """A stage's timing: a moving mean and mean deviation (the first sample, then
    20% of each new one). Written by one side only: see its owner."""

    __slots__ = ("dev", "mean")

    def __init__(self) -> None:
        self.mean = 0.0
        self.dev = 0.0

    def add(self, sample: float) -> None:
        if self.mean == 0.0:
            self.mean = sample
            return
        self.dev += 0.2 * (abs(sample - self.mean) - self.dev)
        self.mean += 0.2 * (sample - self.mean)

    @property
    def high(self) -> float:
        return self.mean + 2.0 * self.dev


class TimedStage:
    """A stage whose run time the handler threads measure; the loop reads ``time.mean``."""

    __slots__ = ("time",)

    def __init__(self) -> None:
        self.time = Spread()  # written on the handler threads only

    def call_threadsafe(self, fn: Callable[[HandlerRequest], Any], request: HandlerRequest) -> Any:
        """On a handler thread: ``fn(request)``, timed into :attr:`time`."""
        t0 = time.perf_counter()
        result = fn(request)
        self.time.add(time.perf_counter() - t0)
        return result


def raw_post_threadsafe(
    fn: Callable[..., Any], name: str, outputs: Any, request: HandlerRequest
) -> Any:
    """On a handler thread: a raw request's postprocess, encoded as its answer."""
    return raw_answer(fn(outputs, request), name)


def stream_threadsafe(
    fn: Callable[[HandlerRequest], Any],
    request: HandlerRequest,
    check: Callable[[Any], Any],
    credits: threading.Semaphore,
    closed: threading.Event,
    push: Callable[[Any], None],
) -> int:
    """On a handler thread: a decoupled handler's ``fn(request)`` generator run
    to its end; returns how many responses it pushed.

    Each response is checked (``check``, which raises for one that is wrong)
    and handed to ``push`` after taking one of ``credits``, which the loop
    gives back as the client takes responses: a slow client holds the
    generator at its ``yield``. When ``closed`` is set (the client went), the
    generator is closed at its next ``yield``: ``GeneratorExit`` is raised
    there, so its ``finally`` runs. Its exceptions propagate, as the
    request's error.
    """
    responses = fn(request)
    if not isinstance(responses, Iterator):
        raise TypeError(
            f"stream returned {type(responses).__name__}, not a generator: yield each response"
        )
    pushed = 0
    try:
        for value in responses:
            response = check(value)
            credits.acquire()  # released by the loop for each response taken, and on close
            if closed.is_set():
                break
            push(response)
            pushed += 1
            if closed.is_set():
                break
    finally:
        close = getattr(responses, "close", None)
        if callable(close):
            close()
    return pushed
