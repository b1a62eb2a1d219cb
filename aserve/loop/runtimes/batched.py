"""One served model version behind a deadline batcher: engine, executor, batcher, statistics.

Layer: loop. Runs on the event loop: loading, warming and unloading send the
blocking parts to threads; requests enter through :meth:`ModelRuntime.infer`.
The engine runs on the executor's threads or in its worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from aserve.codecs.sequence import refuse_sequence
from aserve.config import GpuConfig, ModelConfig, TensorSpec
from aserve.engines import builtin, create_engine
from aserve.engines.base import Engine, ParkError
from aserve.errors import InvalidArgument, Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.device_scheduler import DeviceScheduler
from aserve.loop.direct import direct_rows, instance_batchers, pinned_pool, with_slot
from aserve.loop.request import InferenceRequest
from aserve.loop.runtimes.base import (
    CUT_SHORT_STOP_S,
    ModelState,
    Runtime,
    batching_reconfigurable,
    instance_group,
    not_ready,
    string_parameters,
)
from aserve.loop.sequences import Sequences, sequence_config, sequence_initial_values
from aserve.obs.logs import CURRENT
from aserve.types.tensors import numpy_dtype
from aserve.workers.batch_process import ProcessPool, worker_spec
from aserve.workers.job import BatchJob, ChildProcesses, EnginePool
from aserve.workers.offload import run_off_loop
from aserve.workers.pinned_pool import PinnedPool
from aserve.workers.thread_pool import ExecutorPool

log = logging.getLogger("aserve.model")

PLATFORMS = {
    "torch": "pytorch_torchscript",
    "python": "python",
    "pipeline": "ensemble",
    "onnx": "onnxruntime_onnx",
    "tensorrt": "tensorrt_plan",
}
BACKENDS = {
    "torch": "pytorch",
    "python": "python",
    "pipeline": "",
    "onnx": "onnxruntime",
    "tensorrt": "tensorrt",
}


class ModelRuntime(Runtime):
    """An engine behind a :class:`Batcher`; its request path runs on the loop.

    ``engine`` makes the engine from the weights' path (None for a handler
    without one); by default the one the config's engine names. ``pool``
    makes the executor that runs it, not started, from the engine as made
    (loaded by nobody here: the pool's instances load it); by default the
    config's instance threads (after loading the engine here) or its worker
    processes. A handler's runtime makes its own engine; ``aserve.Batched``
    its function's engine and its worker processes on several devices.
    """

    def __init__(
        self,
        config: ModelConfig,
        base_dir: Path,
        gpu: GpuConfig | None = None,
        engine: Callable[[Path | None], Engine] | None = None,
        pool: Callable[[Engine], EnginePool] | None = None,
        sequenced: bool = True,
    ) -> None:
        super().__init__(config, base_dir, gpu)
        self.max_batch_size = config.batching.max_batch_size
        # A model with sequence_batching: its requests pass their sequence's turn
        # first (not when a handler's runtime, in front of this one, holds it).
        self.sequences: Sequences | None = None
        if config.sequence_batching is not None and sequenced:
            self.sequences = Sequences(self.label, config)
        self._serve_specs_of(config)
        self._make_engine = engine
        self._make_pool = pool
        self._pool: EnginePool | None = None
        self.batcher: Batcher | None = None
        # A direct sequence model's batcher per instance (batcher is the first).
        self._batchers: list[Batcher] = []
        self._device: DeviceScheduler | None = None  # the shared device it runs on, if any
        self._parked = False  # its weights released, the rest kept (park)

    def not_ready_reason(self) -> str | None:
        """Why the model cannot take requests now, or None when it can.

        An instance being restarted does not count while another one serves:
        the batcher routes around it.
        """
        # Spelled out rather than through the base's state_reason(): it runs per request.
        if self.state is not ModelState.READY:
            return not_ready(self.label, self.state.value)
        if self._pool is not None and self._pool.live == 0:
            kind = self.config.executor
            which = "its executor" if self.config.instances == 1 else "every executor"
            return f"model '{self.label}' is not ready: {which} {kind} died and is restarting"
        return None

    @property
    def worker_pids(self) -> list[int]:
        """The model's worker processes (none when its instances are threads)."""
        pool = self._pool
        return pool.pids if isinstance(pool, ChildProcesses) else []

    def model_path(self) -> Path | None:
        """Where the weights are; builds builtin models. Blocking: call off the loop."""
        path = self.config.path
        if path is None:
            return None
        return builtin.locate(path, self._base_dir)

    async def load(self) -> None:
        """Load, start the instances and warm up; the model is READY afterwards.
        A parked one (:meth:`park`) reads its weights back instead, no warm-up
        (its module and latency estimates were kept); a file changed since it
        was loaded is loaded anew."""
        t0 = time.perf_counter()
        self.restored = False
        if self._parked:
            if await self._unpark():
                self.restored = True
                self.serving(self.model_path(), t0, "its weights read back into the kept module")
                return
        path = await self.start()
        await self.warm_up()
        self.serving(path, t0)

    @property
    def parked(self) -> bool:
        return self._parked

    async def park(self) -> int | None:
        """Release the weights, keep the engine, its instances and batcher
        (:meth:`aserve.engines.base.Engine.park`): an evicted on-demand model
        that :meth:`load` reads back in a fraction of a load. The bytes
        released, or None when this runtime cannot park (then unload it).
        Only an idle runtime on instance threads parks."""
        pool = self._pool
        if (
            pool is None or self._make_pool is not None or self.config.executor != "thread"
            or self.state is not ModelState.READY or self.busy
        ):  # fmt: skip
            return None
        self.state = ModelState.UNLOADING  # no batch starts while it releases
        try:
            released = await run_off_loop(
                f"releasing the weights of model '{self.label}'", pool.engine.park
            )
        except BaseException:
            self.state = ModelState.READY  # nothing was released: still whole
            raise
        if released is None:
            self.state = ModelState.READY
            return None
        self._parked = True
        self.state = ModelState.UNAVAILABLE
        return released

    async def _unpark(self) -> bool:
        """The parked weights read back (READY is the caller's to set); False when
        the file changed, with the runtime stopped for a fresh load."""
        assert self._pool is not None
        self.load_step = "reading its weights back"
        try:
            await run_off_loop(f"reading back the weights of model '{self.label}'",
                               self._pool.engine.unpark)  # fmt: skip
        except ParkError as exc:
            log.info("model %s is loaded anew: %s", self.label, exc)
            self._parked = False
            await self._stop()
            return False
        self._parked = False
        return True

    async def start(self) -> Path | None:
        """Load the engine and start the instances and the batcher (not READY yet:
        warm up first); returns where the weights were.

        What may block runs on threads of :func:`run_off_loop`, which a load
        that never ends cannot keep the process from exiting with.
        """
        self.load_step = "locating the model's files"
        path = await run_off_loop(f"locating the files of model '{self.label}'", self.model_path)
        # In a thread: making the engine imports its runtime (torch, onnxruntime), a
        # second or more that would hold the loop, and every other model's start.
        self.load_step = "creating the engine"
        engine = await run_off_loop(
            f"creating the engine of model '{self.label}'", self._create_engine, path
        )
        c = self.config
        if self._make_pool is not None:
            self.load_step = "starting the instances (each loads the model)"
            pool = self._make_pool(engine)
            await pool.start()  # a start that fails stops what it started
            self._pool = pool
        elif c.executor == "process":
            self.load_step = "starting the worker processes (each loads the model)"
            self._pool = await self._start_processes(engine, path)
        else:
            self.load_step = "loading the model"
            await run_off_loop(f"loading model '{self.label}'", engine.load)
            self.load_step = "starting the instance threads"
            if self.sequences is not None and direct_rows(c):
                self._pool = pinned_pool(engine, c, self.name, self.sequences)
            else:
                self._pool = ExecutorPool(engine, c.instances, self.name)
            try:
                await self._pool.start()
            except BaseException:
                await self.free_off_loop(engine.unload)
                raise
        self._serve_specs_of(engine.config)
        if isinstance(self._pool, PinnedPool):
            self._batchers = instance_batchers(self.label, c.batching, self._pool, self.stats)
            self.batcher = self._batchers[0]
        else:
            self.batcher = Batcher(self.label, self.config.batching, self._pool, self.stats)
        for batcher in self._each_batcher():
            batcher.share(self._device)
        return path

    async def _start_processes(self, engine: Engine, path: Path | None) -> ProcessPool:
        """Load the server's side of the engine (``load_front``) and start the worker
        processes at the same time; returns the pool once both are done.

        The children spawn, import torch and the user's module and load the
        weights while the front loads (a tokenizer, say) in a thread: a cold
        start costs the longer of the two, not their sum. A failure is the
        same as one after the other: a front that fails stops the workers
        (started or still starting) and fails with its own error; a worker
        that fails unloads the front and fails with the worker's.
        """
        c = self.config
        spec = worker_spec(c, path, self._base_dir, self.gpu)
        pool = ProcessPool(spec, engine, c.instances, self.name)
        workers = asyncio.ensure_future(pool.start())
        try:
            await run_off_loop(f"loading the front of model '{self.label}'", engine.load_front)
        except BaseException as exc:
            # Still starting: cancelled, the pool's start stops what it started.
            # Started already: stopped here, at once if the load was given up.
            workers.cancel()
            await asyncio.gather(workers, return_exceptions=True)
            given_up = isinstance(exc, asyncio.CancelledError)
            await pool.stop(CUT_SHORT_STOP_S if given_up else self.stop_timeout_s)
            raise
        try:
            await workers
        except BaseException:
            await self.free_off_loop(engine.unload)
            raise
        return pool

    def serving(self, path: Path | None, t0: float, how: str = "") -> None:
        """Started and warmed up (since ``perf_counter()`` ``t0``), or read back
        (``how``): READY."""
        assert self.batcher is not None
        self.state = ModelState.READY
        log.info(
            "model %s loaded from %s on %s (%d instance(s), %s executor, %.2fs%s); batch latency %s",
            self.label, path or self.config.handler, self.config.device, self.config.instances,
            self.config.executor,
            time.perf_counter() - t0, f"; {how}" if how else "",
            {k: f"{v * 1e3:.2f}ms" for k, v in self.batcher.latency.snapshot().items()},
        )  # fmt: skip

    def _create_engine(self, path: Path | None) -> Engine:
        if self._make_engine is not None:
            return self._make_engine(path)
        assert path is not None  # the config requires a path for these engines
        return create_engine(self.config, path)

    def _serve_specs_of(self, served: ModelConfig) -> None:
        """Serve the tensors the loaded engine settled on (an onnx model's may come from
        its file). ``self.config`` stays the config as written."""
        # What the engine takes: a sequence model's control and state inputs too,
        # which the server fills and a client never sends (nor sees in the metadata).
        self.engine_inputs = {s.name: s for s in served.inputs}
        hidden_in: set[str] = set()
        hidden_out: set[str] = set()
        sb = self.config.sequence_batching
        if sb is not None:
            hidden_in = sb.hidden_inputs()
            hidden_out = {st.output for st in sb.state}
        self.input_specs = {s.name: s for s in served.inputs if s.name not in hidden_in}
        self.output_specs = {s.name: s for s in served.outputs if s.name not in hidden_out}
        # Only models with a variable dimension need per-request shape grouping.
        self.variable_shapes = any(-1 in s.shape for s in served.inputs)

    async def warm_up(self) -> None:
        """Run each preferred batch size (and 1 and the max) on every instance.

        The first pass pays one-time costs (allocation, TorchScript profiling);
        the second pass seeds the batcher's latency estimates.
        """
        b = self.config.batching
        sizes = sorted({1, *b.preferred_batch_sizes, b.max_batch_size})
        for measure in (False, True):
            for size in sizes:
                self.load_step = f"warming up (a batch of {size} on each instance)"
                inputs = {
                    s.name: _dummy(s.datatype, s.shape, size) for s in self.engine_inputs.values()
                }
                await asyncio.gather(
                    *(self.warm_batch(inputs, size, measure) for _ in range(self.config.instances))
                )

    async def warm_batch(
        self, inputs: dict[str, np.ndarray], size: int, measure: bool, what: str = ""
    ) -> dict[str, np.ndarray]:
        """Run one batch on an instance, bypassing the queue (warm-up only); with
        ``measure``, its run time seeds the batcher's latency estimates. A
        failure raises RuntimeError, ``what`` failed (by default the batch size)."""
        assert self._pool is not None and self.batcher is not None
        fut: asyncio.Future[BatchJob] = asyncio.get_running_loop().create_future()
        self._pool.submit(BatchJob([inputs], size, _settle_job, (fut, time.perf_counter())))
        job = await fut
        if job.error is not None:
            raise RuntimeError(f"{what or f'warm-up with batch size {size}'} failed: {job.error}")
        if measure:
            for batcher in self._each_batcher():
                batcher.latency.observe(size, job.tag[2])
        assert job.outputs is not None
        return job.outputs

    # --- requests -----------------------------------------------------------------

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
        """Queue one validated request and wait for its outputs.

        Its deadline is ``arrival`` (None: now) + ``timeout_s``; the batcher
        admits it on what is left of that. Refusals (queue full, deadline
        unmeetable or already passed, not ready) raise at once. (The request's
        own ``arrival`` is now, when it joins the queue: what the batcher's
        ``max_delay_ms`` counts from, a wait for company, as before: counted
        from the first bytes, it cut the tiny model's batches short.)
        Cancelling the awaiting task, which is what a frontend sees when its
        client goes away, takes the request out of the queue; a batch already
        running for it finishes, and its answer is dropped.

        A sequence model's request first waits for its turn in its sequence
        (:mod:`aserve.loop.sequences`), within the same deadline.
        """
        if self.sequences is not None:
            return await self._infer_in_sequence(
                self.sequences, inputs, batch_size, shape_key, timeout_s, client_id,
                parameters, arrival,
            )  # fmt: skip
        if parameters and self.config.sequence_batching is None:
            refuse_sequence(parameters, self.label)
        return await self._infer(
            inputs, batch_size, shape_key, timeout_s, client_id, parameters, arrival
        )

    async def _infer_in_sequence(
        self,
        sequences: Sequences,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None,
        parameters: dict[str, Any] | None,
        arrival: float | None,
    ) -> dict[str, np.ndarray]:
        since = time.monotonic() if arrival is None else arrival
        async with sequences.turn(parameters, batch_size, since + timeout_s) as turn:
            filled, via = turn.fill(inputs), None
            if self._batchers:  # direct: the request runs on its sequence's instance and row
                filled, via = with_slot(filled, turn.info.slot, self._batchers)
            outputs = await self._infer(
                filled, batch_size, shape_key, timeout_s, client_id, parameters, since, via
            )
            return turn.keep(outputs)

    async def _infer(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None,
        parameters: dict[str, Any] | None,
        arrival: float | None,
        via: Batcher | None = None,
    ) -> dict[str, np.ndarray]:
        now = time.monotonic()
        since = now if arrival is None else arrival  # what the deadline counts from
        req = InferenceRequest(
            inputs, batch_size, shape_key, now, since + timeout_s,
            asyncio.get_running_loop().create_future(), client_id, parameters,
        )  # fmt: skip
        reason = self.not_ready_reason()
        if reason is not None:
            raise Unavailable(reason)
        batcher = via or self.batcher
        assert batcher is not None
        if batcher.leveled or (parameters and "priority" in parameters):
            req.level = level = batcher.level_of(priority_of(parameters))
            if batcher.leveled:  # the level's queue policy may set its timeout
                timeout = batcher.timeout_at(level, timeout_s, self.default_timeout_s)
                req.deadline = since + timeout
        batcher.submit(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            batcher.forget(req)
            raise
        finally:
            info = CURRENT.get()
            if info is not None and req.dispatched:  # for the access log
                info.queue_s = req.dispatched - req.arrival
                info.compute_s = req.compute_ns / 1e9

    def reserve(self, now: float, deadline: float, items: int, ready_at: float) -> Reservation:
        """Admit, before a stage ahead of this runtime works on it, a request of
        ``items`` that can join the queue at ``ready_at``: raise what :meth:`infer`
        would refuse it with then, counting the requests reserved before.

        Leave the returned reservation (a context manager) when the request
        is queued or given up; its ``predicted`` is when the measured latencies
        say it will be done (None while nothing is measured).
        """
        self.require_ready()
        assert self.batcher is not None
        predicted = self.batcher.reserve(now, deadline, items, ready_at)
        return Reservation(self.batcher, items, predicted)

    def answered_late(self, now: float, budget_s: float, ratio: float | None) -> None:
        """An answer from this runtime's batch reached its client late, or too near
        its deadline, after a stage behind the batch: admission was too optimistic
        (``ratio``: its real time over the predicted one, None when unknown)."""
        if self.batcher is not None:
            self.batcher.answered_late(now, budget_s, ratio)

    # --- state seen by others -----------------------------------------------------

    def _each_batcher(self) -> list[Batcher]:
        """Its batchers: one per instance for a direct sequence model, else the one."""
        return self._batchers or ([] if self.batcher is None else [self.batcher])

    @property
    def busy(self) -> bool:
        if self._batchers:
            return not all(b.idle for b in self._batchers)
        return self.batcher is not None and not self.batcher.idle

    reconfigurable = staticmethod(batching_reconfigurable)

    def reconfigure(self, config: ModelConfig) -> None:
        super().reconfigure(config)
        for batcher in self._each_batcher():
            batcher.reconfigure(config.batching)

    def share(self, device: DeviceScheduler | None) -> None:
        """Run batches on ``device``'s shared slots (None: on its own instances alone)."""
        self._device = device
        for batcher in self._each_batcher():
            batcher.share(device)

    def metadata(self) -> dict[str, Any]:
        return tensor_metadata(self, platform_of(self.config))

    def triton_config(self) -> dict[str, Any]:
        """Settings with no Triton field go in ``parameters`` as strings."""
        c, b = self.config, self.config.batching
        return {
            **tensor_triton_config(self),
            "dynamic_batching": {
                "preferred_batch_size": list(b.preferred_batch_sizes),
                "max_queue_delay_microseconds": round(b.max_delay_ms * 1000),
            },
            **sequence_triton_config(c),
            **instances_triton_config(self),
        }

    def statistics(self) -> dict[str, Any]:
        b = self.batcher
        if self._batchers:
            doc = self.stats.as_dict(
                sum(x.pending for x in self._batchers), sum(x.running for x in self._batchers)
            )
            assert isinstance(self._pool, PinnedPool)
            doc["instance_batches"] = list(self._pool.batches)  # an aserve extension
        else:
            doc = self.stats.as_dict(b.pending if b else 0, b.running if b else 0)
        if b is not None:
            doc["admission_margin"] = b.margin.factor  # an aserve extension, like "rejected"
        if self.sequences is not None:
            doc["sequences_active"] = self.sequences.active  # an aserve extension too
        return doc

    async def _stop(self) -> None:
        """Let running batches end, stop the instances, free the model."""
        if self.sequences is not None:
            self.sequences.close()
        for batcher in self._each_batcher():
            batcher.close()
        pool = self._pool
        if pool is not None:
            await pool.stop(self.stop_timeout_s)
            self._pool = None  # stopped: it has no instances (nor pids) to report
            await self.free_off_loop(pool.engine.unload)


class Reservation:
    """A request admitted to a :class:`ModelRuntime` before it is queued there."""

    __slots__ = ("_batcher", "_items", "predicted")

    def __init__(self, batcher: Batcher, items: int, predicted: float | None) -> None:
        self._batcher = batcher  # the one it was reserved on, should the runtime's change
        self._items = items
        self.predicted = predicted

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self._batcher.release(self._items)


def platform_of(config: ModelConfig) -> str:
    """The model's platform, as metadata and its Triton config name it: Triton's
    names, and for a ``torch.export`` program (``.pt2``, which Triton has no
    name for) ``pytorch_export`` rather than TorchScript's."""
    if config.engine == "torch" and config.path is not None and config.path.endswith(".pt2"):
        return "pytorch_export"
    return PLATFORMS[config.engine]


def tensor_metadata(runtime: Runtime, platform: str) -> dict[str, Any]:
    """KServe's metadata of a model of tensors (every one but a decoder's)."""
    return {
        "name": runtime.name,
        "versions": [runtime.version],
        "platform": platform,
        "inputs": [_tensor_meta(s) for s in runtime.input_specs.values()],
        "outputs": [_tensor_meta(s) for s in runtime.output_specs.values()],
    }


def tensor_triton_config(runtime: Runtime) -> dict[str, Any]:
    """The Triton ModelConfig fields every model of tensors has."""
    engine = runtime.config.engine
    return {
        "name": runtime.name,
        "platform": platform_of(runtime.config),
        "backend": BACKENDS[engine],
        "max_batch_size": runtime.config.batching.max_batch_size,
        "input": [_config_tensor(s) for s in runtime.input_specs.values()],
        "output": [_config_tensor(s) for s in runtime.output_specs.values()],
    }


def sequence_triton_config(config: ModelConfig) -> dict[str, Any]:
    """Triton's ``sequence_batching`` of a model that has it (else nothing)."""
    if config.sequence_batching is None:
        return {}
    return {"sequence_batching": sequence_config(config)}


def instances_triton_config(runtime: Runtime) -> dict[str, Any]:
    """A model's ``instance_group`` and, as strings, its settings with no Triton field."""
    c, b = runtime.config, runtime.config.batching
    return {
        "instance_group": [instance_group(runtime.name, c.instances, c.device)],
        "parameters": string_parameters(
            (
                ("version", runtime.version),
                ("device", c.device),
                ("cpu_threads", c.cpu_threads),
                ("max_queue_size", b.max_queue_size),
                ("timeout_ms", b.timeout_ms),
                *sequence_initial_values(c),
            )
        ),
    }


def priority_of(parameters: dict[str, Any] | None) -> int:
    """The ``priority`` parameter of a request (0: none given), checked."""
    value = 0 if parameters is None else parameters.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"parameter 'priority' must be a non-negative integer (a priority level, 1 the "
            f"highest, or 0 for the model's default), got {value!r}"
        )
    return value


def _settle_job(job: BatchJob) -> None:
    fut, started = job.tag
    job.tag = (fut, started, time.perf_counter() - started)
    if not fut.done():
        fut.set_result(job)


def _tensor_meta(s: TensorSpec) -> dict[str, Any]:
    # Every model has a batch dimension, reported as variable.
    return {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.shape]}


def _config_tensor(s: TensorSpec) -> dict[str, Any]:
    # Triton spells BYTES as TYPE_STRING; dims exclude the batch dimension.
    data_type = "TYPE_STRING" if s.datatype == "BYTES" else f"TYPE_{s.datatype}"
    return {"name": s.name, "data_type": data_type, "dims": list(s.shape)}


def _dummy(datatype: str, shape: list[int], batch: int) -> np.ndarray:
    dims = (batch, *(1 if d == -1 else d for d in shape))
    if datatype == "BYTES":
        arr = np.empty(dims, dtype=object)
        arr.fill(b"")
        return arr
    return np.zeros(dims, dtype=numpy_dtype(datatype))
