"""One served model version: engine, executor threads, batcher and statistics.

Loading, warming and unloading run the blocking parts off the loop; requests
enter through :meth:`ModelRuntime.submit` on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from aserve import builtin_models
from aserve.codecs.datatypes import numpy_dtype
from aserve.config import GpuConfig, ModelConfig
from aserve.engines import create_engine
from aserve.engines.base import Engine
from aserve.engines.executor import BatchJob, ExecutorPool
from aserve.engines.process_pool import ProcessPool, WorkerSpec
from aserve.errors import Unavailable
from aserve.logs import CURRENT
from aserve.loop.request import InferenceRequest
from aserve.scheduler.batcher import Batcher
from aserve.stats import ModelStats

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
DRAIN_POLL_S = 0.02


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class ModelRuntime:
    def __init__(self, config: ModelConfig, base_dir: Path, gpu: GpuConfig | None = None) -> None:
        self.config = config
        self.gpu = gpu or GpuConfig()  # the server's "gpu" block, for worker processes
        self.name = config.name
        self.version = config.version
        self.label = f"{config.name}/{config.version}"
        self.state = ModelState.LOADING
        self.stats = ModelStats(config.name, config.version)
        self.input_specs = {s.name: s for s in config.inputs}
        self.output_specs = {s.name: s for s in config.outputs}
        self.max_batch_size = config.batching.max_batch_size
        self.default_timeout_s = config.batching.timeout_ms / 1000.0
        # Only models with a variable dimension need per-request shape grouping.
        self.variable_shapes = any(-1 in s.shape for s in config.inputs)
        self._base_dir = base_dir
        self._pool: ExecutorPool | ProcessPool | None = None
        self.batcher: Batcher | None = None

    @property
    def ready(self) -> bool:
        """READY, and at least one instance can serve (DESIGN: "Running many of it")."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why the model cannot take requests now, or None when it can.

        An instance being restarted does not count while another one serves:
        the batcher routes around it.
        """
        if self.state is not ModelState.READY:
            return f"model '{self.label}' is not ready ({self.state.value})"
        if self._pool is not None and self._pool.live == 0:
            kind = self.config.executor
            which = "its executor" if self.config.instances == 1 else "every executor"
            return f"model '{self.label}' is not ready: {which} {kind} died and is restarting"
        return None

    @property
    def worker_pids(self) -> list[int]:
        """The model's worker processes (none when its instances are threads)."""
        pool = self._pool
        return pool.pids if isinstance(pool, ProcessPool) else []

    def model_path(self) -> Path | None:
        """Where the weights are; builds builtin models. Blocking: call off the loop."""
        path = self.config.path
        if path is None:
            return None
        return builtin_models.locate(path, self._base_dir)

    async def load(self) -> None:
        """Load, start the instances and warm up; the model is READY afterwards."""
        t0 = time.perf_counter()
        path = await asyncio.to_thread(self.model_path)
        engine = self._create_engine(path)
        c = self.config
        if c.executor == "process":
            await asyncio.to_thread(engine.load_front)
            spec = WorkerSpec(
                c, None if path is None else str(path), str(self._base_dir), self.gpu.model_dump()
            )
            self._pool = ProcessPool(spec, engine, c.instances, self.name)
        else:
            await asyncio.to_thread(engine.load)
            self._pool = ExecutorPool(engine, c.instances, self.name)
        self._serve_specs_of(engine.config)
        try:
            await self._pool.start()
        except BaseException:
            await asyncio.to_thread(engine.unload)
            raise
        self.batcher = Batcher(self.label, self.config.batching, self._pool, self.stats)
        await self._warm_up()
        self.state = ModelState.READY
        log.info(
            "model %s loaded from %s on %s (%d instance(s), %s executor, %.2fs); batch latency %s",
            self.label, path or self.config.handler, self.config.device, self.config.instances,
            self.config.executor,
            time.perf_counter() - t0,
            {k: f"{v * 1e3:.2f}ms" for k, v in self.batcher.latency.snapshot().items()},
        )  # fmt: skip

    def _create_engine(self, path: Path | None) -> Engine:
        assert path is not None  # the config requires a path for these engines
        return create_engine(self.config, path)

    def _serve_specs_of(self, served: ModelConfig) -> None:
        """Serve the tensors the loaded engine settled on (an onnx model's may come from
        its file). ``self.config`` stays the config as written."""
        self.input_specs = {s.name: s for s in served.inputs}
        self.output_specs = {s.name: s for s in served.outputs}
        self.variable_shapes = any(-1 in s.shape for s in served.inputs)

    async def _warm_up(self) -> None:
        """Run each preferred batch size (and 1 and the max) on every instance.

        The first pass pays one-time costs (allocation, TorchScript profiling);
        the second pass seeds the batcher's latency estimates.
        """
        assert self.batcher is not None
        b = self.config.batching
        sizes = sorted({1, *b.preferred_batch_sizes, b.max_batch_size})
        for measure in (False, True):
            for size in sizes:
                inputs = {
                    s.name: _dummy(s.datatype, s.shape, size) for s in self.input_specs.values()
                }
                jobs = await asyncio.gather(
                    *(self._run_direct(inputs, size) for _ in range(self.config.instances))
                )
                for job in jobs:
                    if job.error is not None:
                        raise RuntimeError(f"warm-up with batch size {size} failed: {job.error}")
                    if measure:
                        self.batcher.latency.observe(size, job.tag[2])

    async def _run_direct(self, inputs: dict[str, np.ndarray], size: int) -> BatchJob:
        """Run one batch on an instance, bypassing the batcher (warm-up only).

        The finished job's ``tag[2]`` is its run time in seconds.
        """
        assert self._pool is not None
        fut: asyncio.Future[BatchJob] = asyncio.get_running_loop().create_future()
        self._pool.submit(BatchJob([inputs], size, _settle_job, (fut, time.perf_counter())))
        return await fut

    def submit(self, req: InferenceRequest) -> None:
        reason = self.not_ready_reason()
        if reason is not None:
            raise Unavailable(reason)
        assert self.batcher is not None
        self.batcher.submit(req)

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        batch_size: int,
        shape_key: tuple[Any, ...],
        timeout_s: float,
        client_id: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Queue one validated request and wait for its outputs.

        Refusals (queue full, deadline unmeetable, not ready) raise at once.
        Cancelling the awaiting task, which is what a frontend sees when its
        client goes away, takes the request out of the queue; a batch already
        running for it finishes, and its answer is dropped.
        """
        now = time.monotonic()
        req = InferenceRequest(
            inputs, batch_size, shape_key, now, now + timeout_s,
            asyncio.get_running_loop().create_future(), client_id, parameters,
        )  # fmt: skip
        self.submit(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            if self.batcher is not None:
                self.batcher.forget(req)
            raise
        finally:
            info = CURRENT.get()
            if info is not None and req.dispatched:  # for the access log
                info.queue_s = req.dispatched - req.arrival
                info.compute_s = req.compute_ns / 1e9

    @property
    def busy(self) -> bool:
        """Requests are queued, running, or (subclasses) in pre/post-processing."""
        return self.batcher is not None and not self.batcher.idle

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running (True), or ``timeout_s`` passed (False).

        Used on a runtime that routing no longer reaches: nothing new arrives,
        so polling only has to see the count fall to zero once.
        """
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def reconfigure(self, config: ModelConfig) -> None:
        """Apply a config that differs from the current one only in batching
        settings that need no reload (all but ``max_batch_size``).

        Queued requests keep their deadlines; new ones get the new settings.
        """
        assert config.key == self.config.key
        assert config.batching.max_batch_size == self.config.batching.max_batch_size
        self.config = config
        self.default_timeout_s = config.batching.timeout_ms / 1000.0
        if self.batcher is not None:
            self.batcher.reconfigure(config.batching)

    @staticmethod
    def reconfigurable(old: ModelConfig, new: ModelConfig) -> bool:
        """Whether ``new`` can be applied to a runtime of ``old`` without a reload."""
        if old.batching.max_batch_size != new.batching.max_batch_size:
            return False
        return old.model_copy(update={"batching": new.batching}) == new

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORMS[self.config.engine],
            "inputs": [
                _tensor_meta(s.name, s.datatype, s.shape) for s in self.input_specs.values()
            ],
            "outputs": [
                _tensor_meta(s.name, s.datatype, s.shape) for s in self.output_specs.values()
            ],
        }

    def triton_config(self) -> dict[str, Any]:
        """The model's config in Triton's ModelConfig vocabulary (its JSON form).

        Settings with no Triton field go in ``parameters`` as strings.
        """
        c, b = self.config, self.config.batching
        group: dict[str, Any] = {"name": self.name, "count": c.instances}
        if c.device == "cpu":
            group["kind"] = "KIND_CPU"
        else:
            group["kind"] = "KIND_GPU"
            group["gpus"] = [int(c.device.partition(":")[2] or 0)]
        return {
            "name": self.name,
            "platform": PLATFORMS[c.engine],
            "backend": BACKENDS[c.engine],
            "max_batch_size": b.max_batch_size,
            "input": [
                _config_tensor(s.name, s.datatype, s.shape) for s in self.input_specs.values()
            ],
            "output": [
                _config_tensor(s.name, s.datatype, s.shape) for s in self.output_specs.values()
            ],
            "dynamic_batching": {
                "preferred_batch_size": list(b.preferred_batch_sizes),
                "max_queue_delay_microseconds": round(b.max_delay_ms * 1000),
            },
            "instance_group": [group],
            "parameters": {
                k: {"string_value": str(v)}
                for k, v in (
                    ("version", self.version),
                    ("device", c.device),
                    ("cpu_threads", c.cpu_threads),
                    ("max_queue_size", b.max_queue_size),
                    ("timeout_ms", b.timeout_ms),
                )
            },
        }

    def statistics(self) -> dict[str, Any]:
        b = self.batcher
        doc = self.stats.as_dict(b.pending if b else 0, b.running if b else 0)
        if b is not None:
            doc["admission_margin"] = b.margin.factor  # an aserve extension, like "rejected"
        return doc

    async def unload(self) -> None:
        """Refuse new work, let running batches end, stop threads, free the model."""
        self.state = ModelState.UNLOADING
        if self.batcher is not None:
            self.batcher.close()
        if self._pool is not None:
            await self._pool.stop()
            await asyncio.to_thread(self._pool.engine.unload)
        self.state = ModelState.UNAVAILABLE


def _settle_job(job: BatchJob) -> None:
    fut, started = job.tag
    job.tag = (fut, started, time.perf_counter() - started)
    if not fut.done():
        fut.set_result(job)


def _tensor_meta(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    # Every model has a batch dimension, reported as variable.
    return {"name": name, "datatype": datatype, "shape": [-1, *shape]}


def _config_tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    # Triton spells BYTES as TYPE_STRING; dims exclude the batch dimension.
    data_type = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
    return {"name": name, "data_type": data_type, "dims": list(shape)}


def _dummy(datatype: str, shape: list[int], batch: int) -> np.ndarray:
    dims = (batch, *(1 if d == -1 else d for d in shape))
    if datatype == "BYTES":
        arr = np.empty(dims, dtype=object)
        arr.fill(b"")
        return arr
    return np.zeros(dims, dtype=numpy_dtype(datatype))
