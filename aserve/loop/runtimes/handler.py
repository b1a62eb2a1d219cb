"""A model served by a user's Python handler (``"engine": "python"``).

Layer: loop; runs on the event loop. The handler's stages run in the model's
own handler threads (what runs there is :mod:`.handler_threads`), its
``infer`` on the executor threads or worker processes of the batched runtime
that the stages are composed around. A request goes: ``preprocess`` in one of the model's
handler threads -> the model's batcher, which stacks it with others ->
``infer`` on an executor thread -> ``postprocess`` in a handler thread. Only
the batched middle is shared between requests, so an exception in
``preprocess`` or ``postprocess`` fails only its own request, and one in
``infer`` only the requests of that batch; each answers with the
exception's message. A handler that raises an :class:`aserve.errors.AserveError`
(``InvalidArgument`` for a bad input, say) answers with that error's code.
A raw body (``/predictions``) takes the same path through ``preprocess_raw``
and ``postprocess_raw`` (:meth:`HandlerRuntime.infer_raw`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aserve.codecs.sequence import refuse_sequence
from aserve.config import GpuConfig, ModelConfig, TensorSpec
from aserve.engines.base import Engine
from aserve.engines.python_handler import (
    RAW_METHOD,
    HandlerRequest,
    Part,
    PythonHandlerEngine,
    set_torch_threads,
)
from aserve.errors import (
    AserveError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
)
from aserve.loop.device_scheduler import DeviceScheduler
from aserve.loop.runtimes.base import ModelState, Runtime, batching_reconfigurable
from aserve.loop.runtimes.batched import ModelRuntime
from aserve.loop.runtimes.handler_threads import Spread, TimedStage, raw_post_threadsafe
from aserve.loop.sequences import Sequences
from aserve.obs.handler_metrics import MetricSet
from aserve.obs.stats import ModelStats
from aserve.types.tensors import numpy_dtype, shape_fits, shape_text
from aserve.types.text import first_surrogate

# The last part of a request's time budget that its answer needs to reach the client.
ANSWER_SLACK = 0.05


class HandlerRuntime(Runtime):
    """Pre- and postprocessing stages around a batched runtime that runs ``infer``."""

    def __init__(self, config: ModelConfig, base_dir: Path, gpu: GpuConfig | None = None) -> None:
        super().__init__(config, base_dir, gpu)
        self._engine: PythonHandlerEngine | None = None
        # The batched middle: the handler's infer() behind the model's batcher. Its
        # statistics are the model's (a request counts once, in its batch).
        # A sequence model's turns are held here, around preprocess and postprocess too.
        self._batched = ModelRuntime(
            config, base_dir, gpu, engine=self._create_engine, sequenced=False
        )
        self._sequences: Sequences | None = None
        if config.sequence_batching is not None:
            self._sequences = Sequences(self.label, config)
        self.stats = self._batched.stats
        self.max_batch_size = config.batching.max_batch_size
        self._serve_specs()
        # Pre- and post-processing are per request and may be slow (decoding an
        # image): a few threads of the model's own keep them off the loop
        # without competing with other models' work in the default executor.
        # Each sets torch's intra-op threads (cpu_threads) as it starts, which is after
        # the handler's load: the first runs warm-up's preprocess.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, 2 * config.instances),
            thread_name_prefix=f"aserve-{self.name}-py",
            initializer=set_torch_threads,
            initargs=(config.cpu_threads,),
        )
        self.inflight = 0  # requests between entering infer() and their answer
        self._workers = max(2, 2 * config.instances)
        # Requests waiting for or in preprocessing (not in the batcher's queue
        # yet), and the time one preprocess takes (measured on the handler threads).
        self._preprocessing = 0
        self._preprocess_stage = TimedStage()
        # Batch answered -> postprocess done (thread wait included): the time a batch
        # must leave, as a high estimate (mean + 2 deviations), since a request whose
        # postprocess runs long is as late as one whose batch did. Written on the loop.
        self._tail = Spread()

    def _create_engine(self, path: Path | None) -> Engine:
        self._engine = PythonHandlerEngine(self.config, path, self._base_dir)
        return self._engine

    def _serve_specs(self) -> None:
        """Check requests against the tensors the batched runtime serves."""
        b = self._batched
        self.input_specs, self.output_specs = b.input_specs, b.output_specs
        self.variable_shapes = b.variable_shapes

    @property
    def worker_pids(self) -> list[int]:
        return self._batched.worker_pids

    def use_stats(self, stats: ModelStats) -> None:
        super().use_stats(stats)
        self._batched.use_stats(stats)  # the batched middle counts the model's requests

    def not_ready_reason(self) -> str | None:
        return self.state_reason() or self._batched.not_ready_reason()

    async def load(self) -> None:
        """Start the batched runtime, warm up through every stage; READY afterwards."""
        t0 = time.perf_counter()
        try:
            path = await self._batched.start()
        finally:
            self.load_step = self._batched.load_step
        self._serve_specs()  # as the handler's engine settled them
        await self._warm_up()
        self._batched.serving(path, t0)
        self.state = ModelState.READY

    async def _stop(self) -> None:
        if self._sequences is not None:
            self._sequences.close()
        self._batched.cut_short = self.cut_short  # its stop waits as this one's would
        await self._batched.unload()
        # Not waited for: a preprocess stuck in user code would hold the unload (and
        # the reload or stop behind it) for good. Threads that are still running when
        # the server stops are reported then (aserve.workers.offload.left_behind).
        self._threads.shutdown(wait=False, cancel_futures=True)

    reconfigurable = staticmethod(batching_reconfigurable)

    def reconfigure(self, config: ModelConfig) -> None:
        super().reconfigure(config)
        self._batched.reconfigure(config)

    def share(self, device: DeviceScheduler | None) -> None:
        """The batched middle runs on ``device``'s shared slots (see ModelRuntime.share)."""
        self._batched.share(device)

    def metadata(self) -> dict[str, Any]:
        return self._batched.metadata()

    def triton_config(self) -> dict[str, Any]:
        return self._batched.triton_config()

    def statistics(self) -> dict[str, Any]:
        doc = self._batched.statistics()
        if self._sequences is not None:
            doc["sequences_active"] = self._sequences.active  # an aserve extension
        return doc

    @property
    def handler_metrics(self) -> MetricSet | None:
        """The handler's custom metrics (``context.metrics``), once it is loaded."""
        return None if self._engine is None else self._engine.metrics

    @property
    def busy(self) -> bool:
        return self.inflight > 0 or self._batched.busy

    async def _warm_up(self) -> None:
        """Run the handler's ``warmup_request()`` through every stage, if it has one.

        Without it there is nothing meaningful to feed a user's code, so the
        model starts cold and the batcher learns its latencies from traffic.
        """
        assert self._engine is not None
        example = getattr(self._engine.handler, "warmup_request", None)
        if not callable(example):
            return
        self.load_step = "running the handler's warmup_request()"
        inputs = await self._in_threads(example, "warmup_request")
        batch = _batch_size(inputs, "warmup_request", self.label)
        self.load_step = "warming up (preprocess, infer and postprocess of warmup_request())"
        for measure in (False, True):
            # One request per instance at once, so that each instance (thread or worker
            # process) runs one: a lone one would always go to the first.
            await asyncio.gather(
                *(self._warm_one(inputs, batch, measure) for _ in range(self.config.instances))
            )

    async def _warm_one(self, inputs: dict[str, Any], batch: int, measure: bool) -> None:
        assert self._engine is not None
        request = HandlerRequest(inputs, batch, {}, None)
        arrays = await self._in_threads(self._engine.handler.preprocess, "preprocess", request)
        size, _ = self._batch_of(arrays)
        outputs = await self._batched.warm_batch(arrays, size, measure, "warm-up: infer")
        response = await self._in_threads(
            self._engine.handler.postprocess, "postprocess", outputs, request
        )
        self._response(response, batch)

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
        """preprocess -> batch -> infer -> postprocess; see the module docstring.

        The deadline, ``arrival`` (None: now) + ``timeout_s``, covers the whole
        path; a request whose deadline passes during preprocessing is not queued.
        A sequence model's request waits for its turn in its sequence first
        (:mod:`aserve.loop.sequences`) and holds it through ``postprocess``,
        so its sequence's next request sees what this one left in
        ``request.sequence.state``.
        """
        request = HandlerRequest(inputs, batch_size, dict(parameters or {}), client_id)
        sequences = self._sequences
        if sequences is None:
            refuse_sequence(parameters, self.label)
            response = await self._serve(request, "preprocess", "postprocess", timeout_s, arrival)
            return self._response(response, batch_size)
        since = time.monotonic() if arrival is None else arrival
        async with sequences.turn(parameters, batch_size, since + timeout_s) as turn:
            request.inputs = turn.fill(inputs)
            request.sequence = turn.info
            response = await self._serve(request, "preprocess", "postprocess", timeout_s, since)
            return turn.keep(self._response(response, batch_size))

    def raw_refusal(self) -> str | None:
        """Why this model takes no raw body (``/predictions``), or None when it does."""
        if self._engine is None or self._engine.handler is None:
            return None  # not loaded: the request is refused as not ready
        if callable(getattr(self._engine.handler, RAW_METHOD, None)):
            return None
        return (
            f"model '{self.label}': its handler {self.config.handler} has no "
            f"{RAW_METHOD}(request), so it takes V2 tensors only "
            f"(POST /v2/models/{self.name}/infer)"
        )

    async def infer_raw(
        self,
        body: bytes | list[Part],
        content_type: str,
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
        *,
        arrival: float | None = None,
    ) -> tuple[bytes, str]:
        """A raw body through ``preprocess_raw`` -> batch -> infer -> ``postprocess_raw``
        (else ``postprocess``); the answer's bytes and Content-Type (see
        :func:`aserve.engines.python_handler.raw_answer`). The deadline as
        :meth:`infer`'s."""
        reason = self.raw_refusal()
        if reason is not None:
            raise InvalidArgument(reason)
        if self._sequences is not None:
            raise InvalidArgument(
                f"model '{self.label}' serves sequences: send its requests as V2 tensors "
                f"(POST /v2/models/{self.name}/infer) with the sequence_id parameter"
            )
        refuse_sequence(parameters, self.label)
        request = HandlerRequest({}, 1, dict(parameters or {}), client_id, {}, body, content_type)
        assert self._engine is not None
        post = "postprocess_raw"
        if not callable(getattr(self._engine.handler, post, None)):
            post = "postprocess"
        answer = await self._serve(request, RAW_METHOD, post, timeout_s, arrival, raw=True)
        assert isinstance(answer, tuple)
        return answer

    async def _serve(
        self,
        request: HandlerRequest,
        pre: str,
        post: str,
        timeout_s: float,
        arrival: float | None,
        raw: bool = False,
    ) -> Any:
        """One request through the handler's ``pre`` and ``post`` methods and the batch;
        what ``post`` returned (for a raw request, already as bytes and a type)."""
        # Counted before the first await: a runtime being drained after a
        # reload waits for this request too.
        self.inflight += 1
        try:
            self.require_ready()
            assert self._engine is not None
            now = time.monotonic()
            deadline = (now if arrival is None else arrival) + timeout_s
            if deadline <= now:  # spent before the handler ran (reading the body, a busy loop)
                raise DeadlineExceeded(
                    f"request deadline already passed on arrival at '{self.label}'"
                )
            handler = self._engine.handler
            arrays, predicted = await self._preprocess(request, now, deadline, pre)
            size, key = self._batch_of(arrays, pre)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(
                    f"request deadline passed during preprocessing on '{self.label}'"
                )
            # The batch must end early enough for postprocessing to finish in time too.
            batch_left = max(left - self._tail.high, left / 2)
            outputs = await self._batched.infer(
                arrays, size, key, batch_left, request.id, request.parameters
            )
            t0 = time.monotonic()
            fn = getattr(handler, post)
            if raw:
                response = await self._in_threads(
                    raw_post_threadsafe, post, fn, post, outputs, request
                )
            else:
                response = await self._in_threads(fn, post, outputs, request)
            done = time.monotonic()
            self._tail.add(done - t0)
            slack = ANSWER_SLACK * timeout_s
            if done > deadline - slack:
                # Answered too late for the client, or so close to its deadline that
                # encoding and sending the answer (behind whatever else the loop has
                # to do) may well make it late: admission was too optimistic, by as
                # much as its time with the answer's slack exceeds the prediction.
                ratio = None
                if predicted is not None and predicted + self._tail.high > now:
                    ratio = (done + slack - now) / (predicted + self._tail.high - now)
                self._batched.answered_late(done, timeout_s, ratio)
            return response
        finally:
            self.inflight -= 1

    async def _preprocess(
        self, request: HandlerRequest, now: float, deadline: float, method: str = "preprocess"
    ) -> tuple[Any, float | None]:
        """``preprocess`` in the handler threads, admitted first as the batcher would.

        Returns its result and when admission predicts the request's batch done.

        Under overload the handler threads' queue is where requests would pile
        up, unbounded and unseen by the batcher, until their deadlines were
        spent. So a request that the batcher would refuse once preprocessed
        (its queue full counting those in preprocessing, or its deadline out of
        reach after the preprocessing backlog) is refused before, and one whose
        deadline passes while it waits for a thread is dropped from that queue.
        """
        assert self._engine is not None
        backlog_s = (self._preprocessing // self._workers + 1) * self._preprocess_stage.time.mean
        reservation = self._batched.reserve(
            now,
            # The batch must leave postprocessing its time, but never more than half
            # of the budget (as infer() gives the batcher): a tail estimate that a storm
            # blew up must not refuse every request, and so never be corrected.
            deadline - min(self._tail.high, (deadline - now) / 2),
            request.batch_size,
            ready_at=now + backlog_s,
        )
        self._preprocessing += 1
        try:
            with reservation:
                arrays = await asyncio.wait_for(
                    self._in_threads(
                        self._preprocess_stage.call_threadsafe,
                        method,
                        getattr(self._engine.handler, method),
                        request,
                    ),
                    deadline - now,
                )
            return arrays, reservation.predicted
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                f"request deadline passed waiting for preprocessing on '{self.label}'"
            ) from None
        finally:
            self._preprocessing -= 1

    async def _in_threads(self, fn: Callable[..., Any], stage: str, *args: Any) -> Any:
        """Run user code in the handler threads; its exception becomes this request's error."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._threads, fn, *args)
        except (AserveError, asyncio.CancelledError):
            raise
        except BaseException as exc:  # the user's code failed: only this request fails
            # SystemExit & co. too: raised here, on the loop, they would stop the server.
            raise InternalError(
                f"model '{self.label}' {stage} failed: {type(exc).__name__}: {exc}"
            ) from None

    def _batch_of(self, arrays: Any, method: str = "preprocess") -> tuple[int, tuple[Any, ...]]:
        """Validate what preprocess returned; its batch size and shape key."""
        if not isinstance(arrays, dict) or not arrays:
            raise InternalError(
                f"model '{self.label}' {method} must return a non-empty dict of arrays, "
                f"not {type(arrays).__name__}"
            )
        for name, value in list(arrays.items()):
            if not isinstance(value, np.ndarray):
                arrays[name] = np.asarray(value)
        size = _batch_size(arrays, method, self.label)
        if size > self.max_batch_size:
            raise InvalidArgument(
                f"model '{self.label}': {method} made {size} items, over max_batch_size "
                f"{self.max_batch_size}"
            )
        # Only requests with equal names, dtypes and item shapes can be stacked.
        key = tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(arrays.items()))
        return size, key

    def _response(self, response: Any, batch_size: int) -> dict[str, np.ndarray]:
        """What postprocess returned, as the model's declared outputs."""
        if not isinstance(response, dict):
            raise InternalError(
                f"model '{self.label}' postprocess must return a dict of outputs, "
                f"not {type(response).__name__}"
            )
        out = {}
        for spec in self.config.outputs:
            if spec.name not in response:
                raise InternalError(
                    f"model '{self.label}' postprocess returned no output '{spec.name}'"
                )
            out[spec.name] = as_output(self.label, spec, response[spec.name], batch_size)
        return out


def _batch_size(arrays: Any, stage: str, label: str = "") -> int:
    if not isinstance(arrays, dict) or not arrays:
        raise InternalError(f"{stage} of model '{label}' must return a non-empty dict of arrays")
    sizes = {name: (np.shape(a)[0] if np.ndim(a) else None) for name, a in arrays.items()}
    distinct = set(sizes.values())
    if None in distinct or len(distinct) != 1:
        shown = ", ".join(f"{n}: {s}" for n, s in sizes.items())
        raise InternalError(
            f"model '{label}' {stage}: every array needs the same first (batch) "
            f"dimension (got {shown})"
        )
    size = distinct.pop()
    assert size is not None
    if size < 1:
        raise InternalError(f"model '{label}' {stage}: the batch dimension is empty")
    return size


def as_output(label: str, spec: TensorSpec, value: Any, batch_size: int) -> np.ndarray:
    if spec.datatype == "BYTES":
        given = np.asarray(value, dtype=object)
        items = []
        for x in given.reshape(-1):
            if isinstance(x, str):
                at = first_surrogate(x)
                if at is not None:
                    raise InternalError(
                        f"model '{label}' output '{spec.name}' (BYTES) holds a str that is "
                        f"not valid UTF-8 (a lone surrogate {x[at]!r} at index {at}); "
                        "use bytes for what is not text"
                    )
                x = x.encode()
            elif not isinstance(x, bytes):
                raise InternalError(
                    f"model '{label}' output '{spec.name}' (BYTES) holds a "
                    f"{type(x).__name__}; use bytes or str"
                )
            items.append(x)
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        arr = arr.reshape(given.shape)
    else:
        try:
            arr = np.asarray(value, dtype=numpy_dtype(spec.datatype))
        except (TypeError, ValueError) as exc:
            raise InternalError(
                f"model '{label}' output '{spec.name}' is not {spec.datatype}: {exc}"
            ) from None
    if not shape_fits(arr.shape, spec.shape, batch_size):
        raise InternalError(
            f"model '{label}' output '{spec.name}' has shape {list(arr.shape)}, expected "
            f"{shape_text(spec.shape, batch_size)}"
        )
    return arr
