"""The one place where executor threads hand work back to the event loop.

Executor threads never touch futures, streams or any asyncio object; they call
:func:`post_threadsafe`, which schedules a plain callback on the loop.
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
