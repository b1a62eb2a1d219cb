"""The one place where executor threads hand work back to the event loop (layer: workers).

Executor threads never touch futures, streams or any asyncio object; they call
:func:`post_threadsafe`, which schedules a plain callback on the loop (or
:func:`settle_threadsafe` for an instance's "ready" future). A thread that
answers a job at a time takes a :func:`poster` once, when it starts, so that
answering a job makes no call into this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("aserve.handoff")


def post_threadsafe(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any
) -> None:
    """Run ``callback(*args)`` on ``loop``. Safe to call from any thread.

    If the loop has already closed (process shutting down) the result has no
    one left to receive it and is dropped.
    """
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        log.debug("event loop closed; dropping a result from an executor thread")


def poster(loop: asyncio.AbstractEventLoop) -> Callable[..., object]:
    """``callback(*args)`` on ``loop``, for a thread that posts every job it runs:
    ``loop.call_soon_threadsafe`` itself, bound once, when the thread starts.

    Unlike :func:`post_threadsafe` it raises ``RuntimeError`` once the loop has
    closed (the process is shutting down); the thread then ends, as nothing is
    left to receive its results.
    """
    return loop.call_soon_threadsafe


def settle_threadsafe(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], error: BaseException | None
) -> None:
    """Settle ``fut`` (an instance's "ready" future) on ``loop``, from any thread:
    with ``error``, or done when it is None. A future already settled stays as it is."""
    post_threadsafe(loop, _settle, fut, error)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
