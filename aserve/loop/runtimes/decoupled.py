"""A decoupled model: a python handler that answers a request with any number of
responses (``"decoupled": true``; Triton's decoupled transaction policy).

Layer: loop; runs on the event loop. The handler's ``stream(request)`` is a
generator that runs in one of the model's threads
(:func:`aserve.loop.runtimes.handler_threads.stream_threadsafe`) and hands each
response it yields to the request's :class:`ResponseStream` on the loop. A
request goes::

    stream = runtime.stream(inputs, batch_size, timeout_s, ...)  # refused at once, or queued
    async with stream:                    # leaving early closes the generator
        async for outputs in stream: ...  # one dict of output arrays per response

No batching: each request has a thread of its own for as long as its generator
runs, ``instances`` of them at once. Requests beyond wait for a thread in
arrival order, each until its deadline (then DeadlineExceeded), at most
``batching.max_queue_size`` of them (then QueueFull). The deadline bounds the
wait for a thread only: a stream that has started runs to its end, as a
decoder's generation does. The generator runs at most :data:`STREAM_WINDOW`
responses ahead of what the client has taken: a slow client holds it at its
``yield`` rather than letting responses pile up here.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import GpuConfig, ModelConfig
from aserve.engines import builtin
from aserve.engines.python_handler import HandlerRequest, PythonHandlerEngine, set_torch_threads
from aserve.errors import (
    AserveError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    QueueFull,
    Unavailable,
)
from aserve.loop.runtimes.base import (
    Decoupled,
    ModelState,
    load_timeout_only,
)
from aserve.loop.runtimes.batched import (
    instances_triton_config,
    platform_of,
    tensor_metadata,
    tensor_triton_config,
)
from aserve.loop.runtimes.handler import as_output
from aserve.loop.runtimes.handler_threads import stream_threadsafe
from aserve.obs.handler_metrics import MetricSet
from aserve.workers.handoff import post_threadsafe
from aserve.workers.offload import run_off_loop

log = logging.getLogger("aserve.model")

# How many responses a generator may run ahead of the client's reading.
STREAM_WINDOW = 8


class DecoupledRuntime(Decoupled):
    """A handler's ``stream`` per request, in the model's own threads."""

    def __init__(self, config: ModelConfig, base_dir: Path, gpu: GpuConfig | None = None) -> None:
        super().__init__(config, base_dir, gpu)
        self.input_specs = {s.name: s for s in config.inputs}
        self.output_specs = {s.name: s for s in config.outputs}
        self.max_batch_size = config.batching.max_batch_size
        self.variable_shapes = any(-1 in s.shape for s in config.inputs)
        self._engine: PythonHandlerEngine | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.instances,
            thread_name_prefix=f"aserve-{self.name}-stream",
            initializer=set_torch_threads,
            initargs=(config.cpu_threads,),
        )
        self._slots = asyncio.Semaphore(config.instances)
        self._streams: set[ResponseStream] = set()  # waiting for a thread or running
        self.waiting = 0
        self.running = 0
        self.responses = 0  # sent since load: an aserve extension of the statistics

    # --- lifecycle --------------------------------------------------------------

    async def load(self) -> None:
        t0 = time.perf_counter()
        c = self.config
        self.load_step = "locating the model's files"
        path = None
        if c.path is not None:
            what = f"locating the files of model '{self.label}'"
            path = await run_off_loop(what, builtin.locate, c.path, self._base_dir)
        self.load_step = "loading the handler"
        engine = PythonHandlerEngine(c, path, self._base_dir)
        await run_off_loop(f"loading model '{self.label}'", engine.load)
        self._engine = engine
        self.state = ModelState.READY
        log.info(
            "model %s loaded from %s (decoupled, %d stream(s) at once, %.2fs)",
            self.label, c.handler, c.instances, time.perf_counter() - t0,
        )  # fmt: skip

    async def _stop(self) -> None:
        self.end_streams()
        # Not waited for: a generator stuck in user code would hold the unload (and
        # the reload or stop behind it) for good; it ends at its next yield.
        self._threads.shutdown(wait=False, cancel_futures=True)
        engine, self._engine = self._engine, None
        if engine is not None:
            await self.free_off_loop(engine.unload)

    def end_streams(self) -> None:
        for stream in list(self._streams):
            stream.end(Unavailable(f"model '{self.label}' is unloading; the stream was cut off"))

    @property
    def busy(self) -> bool:
        return bool(self._streams)

    @staticmethod
    def reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
        return load_timeout_only(old, new)

    @property
    def handler_metrics(self) -> MetricSet | None:
        return None if self._engine is None else self._engine.metrics

    # --- requests ---------------------------------------------------------------

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> dict[str, np.ndarray]:
        # Triton's rule: a decoupled model's responses need a route that streams them.
        raise InvalidArgument(
            f"model '{self.label}' is decoupled (it answers a request with any number of "
            "responses): the infer route takes one answer per request; use gRPC "
            f"ModelStreamInfer or POST /v2/models/{self.name}/generate_stream"
        )

    def stream(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> ResponseStream:
        self.require_ready()
        now = time.monotonic()
        deadline = (now if arrival is None else arrival) + timeout_s
        if deadline <= now:
            raise DeadlineExceeded(f"request deadline already passed on arrival at '{self.label}'")
        if self._slots.locked() and self.waiting >= self.config.batching.max_queue_size:
            self.stats.rejected["queue_full"] += 1
            raise QueueFull(
                f"model '{self.label}': {self.waiting} requests wait for one of its "
                f"{self.config.instances} stream(s) (max_queue_size "
                f"{self.config.batching.max_queue_size})"
            )
        request = HandlerRequest(inputs, batch_size, dict(parameters or {}), client_id)
        stream = ResponseStream(self, request, deadline, now)
        self._streams.add(stream)
        return stream

    async def _run(self, stream: ResponseStream) -> None:
        """One stream's life on the loop: wait for a thread (by deadline), run the
        generator there, then settle the stream and free the thread."""
        self.waiting += 1
        try:
            left = stream.deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._slots.acquire(), max(left, 0.0))
            except asyncio.TimeoutError:
                self.stats.timed_out += 1
                raise DeadlineExceeded(
                    f"request deadline passed waiting for one of model '{self.label}''s "
                    f"{self.config.instances} stream(s)"
                ) from None
        finally:
            self.waiting -= 1
        stream.started = True
        self.running += 1
        self.stats.queue.add(int((time.monotonic() - stream.queued_at) * 1e9))
        try:
            engine = self._engine
            if engine is None or self.state is not ModelState.READY:
                raise Unavailable(f"model '{self.label}' is unloading")
            loop = asyncio.get_running_loop()
            check = functools.partial(self._response, stream.request.batch_size)
            push = functools.partial(post_threadsafe, loop, stream.push)
            run = loop.run_in_executor(
                self._threads, stream_threadsafe, engine.handler.stream, stream.request,
                check, stream.credits, stream.closed, push,
            )  # fmt: skip
            try:
                # Shielded: a cancelled stream's thread ends at its generator's next
                # yield, and only then is its thread free for the next request.
                await asyncio.shield(run)
            except asyncio.CancelledError:
                await asyncio.wait([run])
                raise
            except AserveError:
                raise
            except BaseException as exc:  # the user's code failed: only this request fails
                # SystemExit & co. too: raised here, on the loop, they would stop the server.
                raise self._failed(exc) from None
        finally:
            self.running -= 1
            self._slots.release()
        self.stats.execution_count += 1
        self.stats.inference_count += stream.request.batch_size
        self.stats.last_inference_ms = int(time.time() * 1000)

    def _failed(self, exc: BaseException) -> InternalError:
        return InternalError(f"model '{self.label}' stream failed: {type(exc).__name__}: {exc}")

    def _response(self, batch_size: int, value: Any) -> dict[str, np.ndarray]:
        """On a handler thread: one yielded response, as the model's declared outputs."""
        if not isinstance(value, dict):
            raise TypeError(f"stream yielded {type(value).__name__}, not a dict of outputs")
        unknown = sorted(set(value) - set(self.output_specs))
        if unknown:
            raise TypeError(
                f"stream yielded output(s) {', '.join(map(repr, unknown))} that the model does "
                f"not declare (its outputs: {', '.join(self.output_specs)})"
            )
        out = {}
        for name, spec in self.output_specs.items():
            if name not in value:
                raise TypeError(f"stream yielded a response without output '{name}'")
            out[name] = as_output(self.label, spec, value[name], batch_size)
        return out

    def _ended(self, stream: ResponseStream, error: BaseException | None, started: float) -> None:
        self._streams.discard(stream)
        ns = int((time.monotonic() - started) * 1e9)
        if error is None:
            self.stats.success.add(ns)
        elif isinstance(error, asyncio.CancelledError):
            self.stats.cancelled += 1
        else:
            self.stats.fail.add(ns)

    # --- what is reported -------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return tensor_metadata(self, platform_of(self.config))

    def triton_config(self) -> dict[str, Any]:
        return {
            **tensor_triton_config(self),
            "model_transaction_policy": {"decoupled": True},
            **instances_triton_config(self),
        }

    def statistics(self) -> dict[str, Any]:
        doc = self.stats.as_dict(self.waiting, self.running)
        doc["response_count"] = self.responses  # an aserve extension, like "rejected"
        return doc


class ResponseStream:
    """One decoupled request's responses, on the loop: an async context manager and
    an async iterator of output dicts.

    Its generator's thread pushes each response (through
    :func:`aserve.workers.handoff.post_threadsafe`, so :meth:`push` runs on the
    loop) after taking one of :attr:`credits`; taking a response here gives the
    credit back. Leaving the ``async with`` before the end closes the stream:
    :attr:`closed` is set (the generator is closed at its next ``yield``) and a
    request still waiting for a thread leaves the queue.
    """

    def __init__(
        self, runtime: DecoupledRuntime, request: HandlerRequest, deadline: float, now: float
    ) -> None:
        self.request = request
        self.deadline = deadline
        self.queued_at = now
        self.credits = threading.Semaphore(STREAM_WINDOW)
        self.closed = threading.Event()
        request.cancelled = self.closed.is_set
        self.started = False  # has a thread (set by the runtime)
        self._runtime = runtime
        self._items: collections.deque[dict[str, np.ndarray]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._done = False
        self._task = asyncio.ensure_future(runtime._run(self))
        self._task.add_done_callback(self._settle)

    def push(self, outputs: dict[str, np.ndarray]) -> None:
        """A response from the generator's thread (called on the loop)."""
        if self._done:
            return  # ended early (a drain's cut-off): the rest has no reader
        self._items.append(outputs)
        self._wake()

    def end(self, error: AserveError) -> None:
        """End the stream now with ``error`` (what is queued is not sent)."""
        if self._done:
            return
        self._items.clear()
        self._finish(error)
        self.closed.set()
        self.credits.release()  # wakes a generator waiting for a credit
        if not self.started:
            self._task.cancel()  # still waiting for a thread: leaves the queue

    def _settle(self, task: asyncio.Future[None]) -> None:
        error = None if not task.cancelled() else asyncio.CancelledError()
        if error is None:
            error = task.exception()
        if not self._done:
            self._finish(error)
        self._runtime._ended(self, error, self.queued_at)

    def _finish(self, error: BaseException | None) -> None:
        self._done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task.done():
            return
        self.closed.set()
        self.credits.release()
        self._task.cancel()  # waiting for a thread: leaves; running: ends at its next yield

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> dict[str, np.ndarray]:
        while not self._items:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self.credits.release()
        self._runtime.responses += 1
        return self._items.popleft()
