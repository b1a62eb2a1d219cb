"""``Batched``: aserve's deadline batcher inside your own web app (the caller's side).

Calls come from any thread (``batched(x)``: Flask, Django, scripts) or any
event loop (``await batched.acall(x)``: FastAPI, aiohttp); the batcher,
its queue and its timers live on one event loop (see
:mod:`aserve.library.core`), which calls reach only through
``asyncio.run_coroutine_threadsafe``. That loop is the caller's when the
``Batched`` is started with ``async with`` / ``await astart()`` (an app's
lifespan, which also ends it), else a daemon thread of its own, started on
the first call and stopped by ``close()``, a ``with`` block or at exit.

Why ``acall`` and not an awaitable ``__call__``: a call that returns a
result in one context and a coroutine in another breaks type checkers and
fails silently when an ``await`` is forgotten. Two names, one per side,
as Django's ``get``/``aget`` and httpx's ``Client``/``AsyncClient`` do.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.util
import logging
import re
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from aserve.codecs.timeouts import as_timeout
from aserve.config import BatchingConfig
from aserve.errors import AserveError, DeadlineExceeded, InternalError, Unavailable
from aserve.library.core import Core
from aserve.library.loop_thread import LoopThread
from aserve.library.values import pack_value, unpack_value

log = logging.getLogger("aserve.library")

In = TypeVar("In")
Out = TypeVar("Out")

_DEVICE = re.compile(r"cpu|cuda|cuda:\d+")
# How long past its deadline a caller still waits for an answer from the loop
# before it gives up on the loop itself (the batcher answers every call by its
# deadline; this only bounds a wait on a loop that is gone).
_WATCHDOG_S = 5.0
# The longest a call may wait: what a thread can wait for, less the watchdog's
# margin (about 292 years; a larger finite timeout_ms means "as long as can be").
_LONGEST_S = threading.TIMEOUT_MAX - _WATCHDOG_S


class Timeout(DeadlineExceeded, TimeoutError):
    """The call's timeout passed before its batch answered it (also a ``TimeoutError``)."""


class BatchFailed(InternalError):
    """The function failed the batch this call was in: it raised (``__cause__`` is
    what it raised), returned the wrong number of results, or its worker died."""


class Batched(Generic[In, Out]):
    """Batch the calls of many threads or tasks into calls of ``fn`` on lists.

    ``fn`` takes a list of inputs and returns a list of as many results, in
    order (with ``stack=True``: one numpy array of the inputs stacked, and an
    array or list of as many rows). It is a callable, a class with
    ``predict(batch)`` and an optional ``load(device)``, or the import path of
    either (``"package.module:name"``). With ``workers=N`` it runs in N
    worker processes spread over ``devices`` (worker ``i`` on
    ``devices[i % len(devices)]``), each importing and loading it itself:
    then it must be an import path, and inputs and results must be msgpack
    values or numpy arrays of numbers (they are never pickled). Without
    workers it runs on one thread of this process.

    Batches are formed by aserve's deadline batcher: a batch runs as soon as
    the function is free, as large as the queue allows (up to
    ``max_batch_size``); ``max_delay_ms`` bounds how long a call waits for
    company, and a call waits for it only while the measured batch times say
    that a bigger batch pays. A call not answered within ``timeout_ms`` raises
    :class:`Timeout`; a function that raises fails its batch only
    (:class:`BatchFailed`); a worker that dies fails its batch only and is
    restarted. More than ``max_queue_size`` waiting calls are refused at
    once (:class:`aserve.errors.QueueFull`), and so is a call whose
    deadline the measured latencies say cannot be met
    (:class:`aserve.errors.Unavailable`).
    """

    def __init__(
        self,
        fn: Callable[[Any], Any] | str,
        *,
        max_batch_size: int = 32,
        max_delay_ms: float = 2.0,
        timeout_ms: float = 5000.0,
        max_queue_size: int = 1024,
        stack: bool = False,
        workers: int = 0,
        devices: Sequence[str] = ("cpu",),
        name: str | None = None,
    ) -> None:
        devices = [devices] if isinstance(devices, str) else list(devices)
        _check_target(fn, workers, devices)
        _check_timeout_ms(timeout_ms)
        self.name = name or (fn if isinstance(fn, str) else _name_of(fn))
        self._batching = BatchingConfig(
            max_batch_size=max_batch_size, max_delay_ms=max_delay_ms,
            max_queue_size=max_queue_size, timeout_ms=timeout_ms,
        )  # fmt: skip
        self._stack = stack
        self._wire = workers > 0  # inputs and results cross a pipe as msgpack
        self._core = Core(fn, self.name, self._batching, stack, workers, devices)
        self._lock = threading.Lock()
        self._started: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: LoopThread | None = None
        self._closed = False

    # --- calls -----------------------------------------------------------------

    def __call__(self, item: In, *, timeout_ms: float | None = None) -> Out:
        """The function's result for ``item``, computed in a batch (blocks this thread)."""
        timeout_s = self._timeout_s(timeout_ms)
        loop = self._ready_sync()
        cf = asyncio.run_coroutine_threadsafe(self._infer(item, timeout_s), loop)
        try:
            outputs = cf.result(timeout_s + _WATCHDOG_S)
        except AserveError as exc:
            err = _translate(exc)
            if err is exc:
                raise
            raise err from err.__cause__
        except concurrent.futures.TimeoutError:
            cf.cancel()
            raise Timeout(self._lost(timeout_s)) from None
        return self._decode(outputs)

    async def acall(self, item: In, *, timeout_ms: float | None = None) -> Out:
        """The function's result for ``item``, computed in a batch, from any event loop.

        Cancelling the awaiting task takes the call out of the queue (a batch
        already running for it finishes; its answer is dropped).
        """
        timeout_s = self._timeout_s(timeout_ms)
        started = self._begin(None)
        if started.done():
            started.result()  # a failed load raises here
        else:
            await asyncio.wrap_future(started)  # the first calls wait for the load
        loop = self._loop
        assert loop is not None
        coro = self._infer(item, timeout_s)
        try:
            if loop is asyncio.get_running_loop():
                outputs = await coro
            else:
                cf = asyncio.run_coroutine_threadsafe(coro, loop)
                outputs = await asyncio.wait_for(asyncio.wrap_future(cf), timeout_s + _WATCHDOG_S)
        except AserveError as exc:
            err = _translate(exc)
            if err is exc:
                raise
            raise err from err.__cause__
        except asyncio.TimeoutError:  # wait_for's: the loop did not answer at all
            raise Timeout(self._lost(timeout_s)) from None
        return self._decode(outputs)

    def submit(
        self, item: In, *, timeout_ms: float | None = None
    ) -> concurrent.futures.Future[Out]:
        """A future of the result for ``item``, without blocking on it (after the first
        start). Cancelling the future takes the call out of the queue."""
        timeout_s = self._timeout_s(timeout_ms)
        loop = self._ready_sync()
        raw = asyncio.run_coroutine_threadsafe(self._infer(item, timeout_s), loop)
        out: concurrent.futures.Future[Out] = concurrent.futures.Future()

        def settle(f: concurrent.futures.Future[dict[str, np.ndarray]]) -> None:
            if f.cancelled():
                out.cancel()
                return
            try:
                exc = f.exception()
                if exc is None:
                    out.set_result(self._decode(f.result()))
                else:
                    out.set_exception(_translate(exc))
            except concurrent.futures.InvalidStateError:
                pass  # the caller cancelled it meanwhile
            except Exception as exc:  # decoding the result failed
                out.set_exception(exc)

        raw.add_done_callback(settle)
        out.add_done_callback(lambda f: raw.cancel() if f.cancelled() else None)
        return out

    def stats(self) -> dict[str, Any]:
        """The batcher's statistics: requests, batches (``batch_sizes``: size -> batches
        run), queue (``pending_request_count``), timeouts, worker pids and restarts."""
        with self._lock:
            started, loop, closed = self._started, self._loop, self._closed
        if started is None or loop is None or closed or _running_loop() is loop:
            return self._core.snapshot()  # nothing runs on its loop, or this is its loop
        return asyncio.run_coroutine_threadsafe(_call(self._core.snapshot), loop).result(30)

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Load the function now (the first call does it otherwise); blocks until loaded."""
        self._ready_sync()

    async def astart(self) -> None:
        """Start on the running event loop (no thread of its own), e.g. in an app's lifespan;
        close it there with ``await aclose()``."""
        await asyncio.wrap_future(self._begin(asyncio.get_running_loop()))

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new calls, answer queued ones (unavailable), let running batches end,
        stop the workers and the loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None and self._loop is not None and _running_loop() is self._loop:
                raise RuntimeError(f"Batched '{self.name}' runs on this loop: use await aclose()")
            self._closed = True
            started, loop, thread = self._started, self._loop, self._thread
        atexit.unregister(self._close_at_exit)
        if started is None or loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(started), loop).result(timeout)
        except RuntimeError:
            pass  # its loop is closed already: nothing runs on it any more
        except concurrent.futures.TimeoutError:
            log.warning("Batched '%s' did not stop within %.1fs", self.name, timeout)
        if thread is not None:
            thread.stop()

    async def aclose(self) -> None:
        """:meth:`close`, from a coroutine (on the loop it runs on, or any other)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started, loop, thread = self._started, self._loop, self._thread
        atexit.unregister(self._close_at_exit)
        if started is None or loop is None:
            return
        if loop is asyncio.get_running_loop():
            await self._shutdown(started)
        else:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._shutdown(started), loop)
            )
        if thread is not None:
            await asyncio.to_thread(thread.stop)

    def __enter__(self) -> Batched[In, Out]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Batched[In, Out]:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- inside ------------------------------------------------------------------

    def _begin(self, bind: asyncio.AbstractEventLoop | None) -> concurrent.futures.Future[None]:
        """Start once (on ``bind``, else on a thread of its own); the start's future."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"Batched '{self.name}' is closed")
            if self._started is None:
                if bind is None:
                    self._thread = LoopThread(f"aserve-batched-{self.name}")
                    bind = self._thread.loop
                self._loop = bind
                self._started = asyncio.run_coroutine_threadsafe(self._core.load(), bind)
                atexit.register(self._close_at_exit)
            return self._started

    def _ready_sync(self) -> asyncio.AbstractEventLoop:
        started = self._begin(None)
        loop = self._loop
        assert loop is not None
        if _running_loop() is loop:
            raise RuntimeError(
                f"Batched '{self.name}' was called without await on the event loop it runs on, "
                "which would block that loop: use `await batched.acall(x)` there"
            )
        started.result()  # the first call waits for the load; a failed load raises here
        return loop

    async def _shutdown(self, started: concurrent.futures.Future[None]) -> None:
        try:
            await asyncio.wrap_future(started)  # a stop during the start waits for it
        except Exception:
            pass  # a start that failed left nothing running
        await self._core.unload()

    def _close_at_exit(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            self.close(timeout=10.0)

    def _timeout_s(self, timeout_ms: float | None) -> float:
        """The call's timeout in seconds; ValueError, before anything is queued, for a
        ``timeout_ms`` that is not a finite positive number (the server's rule)."""
        ms = self._batching.timeout_ms if timeout_ms is None else _check_timeout_ms(timeout_ms)
        return min(ms / 1000.0, _LONGEST_S)

    def _infer(self, item: Any, timeout_s: float) -> Coroutine[Any, Any, dict[str, np.ndarray]]:
        """The call as the core's request of one item (encoded here, in the caller)."""
        inputs, shape_key = self._encode(item)
        return self._core.infer(inputs, 1, shape_key, timeout_s)

    def _encode(self, item: Any) -> tuple[dict[str, np.ndarray], tuple[Any, ...]]:
        """The call as the batcher's one-item tensor and its shape key (in the caller)."""
        if self._stack:
            arr = np.asarray(item)
            if arr.dtype.kind not in "biufc":
                raise TypeError(
                    f"Batched '{self.name}' stacks its inputs (stack=True): give a numpy array "
                    f"of numbers, not a {type(item).__name__} of dtype {arr.dtype}"
                )
            # Only items of one shape and dtype can be stacked: the key keeps them apart.
            return {"x": arr[np.newaxis]}, (arr.dtype.str, arr.shape)
        cell = np.empty(1, dtype=object)
        cell[0] = pack_value(item, f"the input of '{self.name}'") if self._wire else item
        return {"v": cell}, ()

    def _decode(self, outputs: dict[str, np.ndarray]) -> Any:
        if "y" in outputs:
            return outputs["y"][0]
        value = outputs["v"][0]
        return unpack_value(value) if self._wire else value

    def _lost(self, timeout_s: float) -> str:
        return (
            f"Batched '{self.name}': no answer within {timeout_s + _WATCHDOG_S:.1f}s "
            f"(timeout {timeout_s:.3f}s): its event loop does not answer"
        )


def _translate(exc: BaseException) -> BaseException:
    """The library's error for what the batcher answered a call with."""
    if isinstance(exc, DeadlineExceeded) and not isinstance(exc, Timeout):
        return Timeout(exc.message)
    if isinstance(exc, InternalError) and not isinstance(exc, BatchFailed):
        err = BatchFailed(exc.message)
        err.__cause__ = exc.__cause__  # what the function raised (the batcher keeps it)
        return err
    return exc


def _check_target(fn: Any, workers: int, devices: list[str]) -> None:
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an int >= 0, got {workers!r}")
    if not devices:
        raise ValueError("devices: give at least one, e.g. ['cpu'] or ['cuda:0', 'cuda:1']")
    for d in devices:
        if not isinstance(d, str) or not _DEVICE.fullmatch(d):
            raise ValueError(f"devices: '{d}' is not a device: use cpu, cuda or cuda:N")
    if workers == 0:
        if len(devices) > 1:
            raise ValueError(
                f"devices={devices} spreads worker processes over devices: give workers=N too"
            )
        if not (isinstance(fn, str) or callable(fn)):
            raise TypeError(f"fn must be callable or an import path, not {type(fn).__name__}")
        return
    if not isinstance(fn, str):
        raise TypeError(
            f"with workers={workers} give the function by import path ('package.module:function' "
            "or 'package.module:Class'): each worker imports it itself, as objects are never "
            "pickled to a worker"
        )
    module, sep, attr = fn.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"'{fn}' is not an import path: write 'package.module:function'")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot find module '{module}' of '{fn}': {exc}") from None
    if found is None:
        raise ValueError(f"cannot find module '{module}' of '{fn}' on sys.path")


def _check_timeout_ms(timeout_ms: Any) -> float:
    ms = as_timeout(timeout_ms)
    if ms is None:
        raise ValueError(f"timeout_ms must be a finite positive number (got {timeout_ms!r})")
    return ms


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()
