"""Blocking calls that may never return, each on a thread the server can leave behind.

Layer: ``workers``. :func:`run_off_loop` is called on the loop; the call it
makes runs on a thread of its own and hands its outcome back through
:mod:`aserve.workers.handoff`.

Why not ``asyncio.to_thread``: its threads belong to the loop's default
executor, which the loop joins when it closes, and ``concurrent.futures``
joins them again at interpreter exit. One call that never returns there (a
model whose load or ``initialize`` hangs, a TorchScript ``forward`` that
loops) makes the process unkillable. Loading a model is the place where user
code runs long with nobody waiting for an answer, so model loads run here:
on a daemon thread, one per call. Cancelling the await (a load timeout, a
stop) leaves the thread running, since no Python thread can be interrupted;
its late result is dropped.

A thread that could not be stopped is remembered (:func:`leave_behind`, also
for executor threads stuck in a batch), and :func:`left_behind` lists those
still running when the server stops: a process that still has them must end
with ``os._exit`` (an interpreter that finalises under a thread running
native code aborts) and says so with a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aserve.workers.handoff import post_threadsafe

T = TypeVar("T")

_lock = threading.Lock()
# Threads of run_off_loop still running, and threads given up on (leave_behind),
# with what each is doing.
_threads: dict[threading.Thread, str] = {}


async def run_off_loop(what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a daemon thread of its own; its result or its exception.

    ``what`` says what the call does, for :func:`left_behind` ("loading the
    engine of model 'm/1'"). Cancelled, the await ends at once and the thread
    runs on; it is listed by :func:`left_behind` until it returns. A
    ``SystemExit`` or the like from ``fn`` comes back as a ``RuntimeError``:
    raised on the loop, it would stop the server.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def call_threadsafe() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting side, whatever it is
            if not isinstance(exc, Exception):
                exc = RuntimeError(f"{what} raised {exc!r}")
            post_threadsafe(loop, _settle, fut, None, exc)
        else:
            post_threadsafe(loop, _settle, fut, result, None)
        finally:
            with _lock:
                _threads.pop(thread, None)

    thread = threading.Thread(target=call_threadsafe, name="aserve-offload", daemon=True)
    with _lock:
        _threads[thread] = what
    thread.start()
    return await fut


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # its awaiter was cancelled: nobody wants it
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def leave_behind(thread: threading.Thread, what: str) -> None:
    """Note that ``thread`` (doing ``what``) was asked to stop and did not."""
    with _lock:
        _threads[thread] = what


def left_behind(join_s: float = 1.0) -> list[str]:
    """What the threads of :func:`run_off_loop` and those given up on, and any
    thread that is not a daemon, are still doing.

    Blocking (call off the loop, or after it closed). The server calls it
    once everything was stopped: threads that are ending anyway (a thread
    pool shut down without waiting) get ``join_s`` in all to finish.
    """
    deadline = time.monotonic() + join_s
    with _lock:
        for thread in [t for t in _threads if not t.is_alive()]:
            del _threads[thread]
        known = dict(_threads)
    found = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread is threading.main_thread():
            continue
        if thread.daemon and thread not in known:
            continue
        # A thread that is ending anyway (a pool's, told to end; a load cut short
        # that was nearly done) gets what is left of the grace.
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            found.append(known.get(thread) or f"thread '{thread.name}'")
    return found
