"""The loop side of a ``Batched``: its pool of instances, its batcher, its statistics.

Everything here runs on the event loop the ``Batched`` was started on (its
own thread's, or the caller's); :mod:`aserve.library.batched` hands calls
over with ``run_coroutine_threadsafe``. It is a small ``ModelRuntime``: the
same :class:`aserve.loop.batcher.Batcher` queues the calls by deadline
and cuts batches from its latency model, and an
:class:`aserve.workers.thread_pool.ExecutorPool` (the function in this process,
on one executor thread) or process pools (the function in worker
processes) run them.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import BatchingConfig, ModelConfig, TensorSpec
from aserve.engines.python_handler import PythonHandlerEngine
from aserve.library.pools import DevicePools, spread
from aserve.library.runner import FunctionEngine
from aserve.loop.batcher import Batcher
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.workers.batch_process import ProcessPool, WorkerSpec
from aserve.workers.job import ChildProcesses, EnginePool
from aserve.workers.thread_pool import ExecutorPool

WORKER_HANDLER = "aserve.library.runner:WorkerHandler"


def _config(
    label: str, batching: BatchingConfig, device: str, instances: int, parameters: dict[str, Any]
) -> ModelConfig:
    tensor = [TensorSpec(name="v", datatype="BYTES", shape=[])]
    return ModelConfig(
        name=re.sub(r"[^A-Za-z0-9_.\-]", "_", label) or "batched",
        engine="python",
        handler=WORKER_HANDLER,
        parameters=parameters,
        device=device,
        instances=instances,
        executor="process" if parameters else "thread",
        inputs=tensor,
        outputs=tensor,
        batching=batching,
    )


class Core:
    """One ``Batched``'s serving machinery, on its loop."""

    def __init__(
        self,
        target: Any,
        label: str,
        batching: BatchingConfig,
        stack: bool,
        workers: int,
        devices: Sequence[str],
    ) -> None:
        self.target = target
        self.label = label
        self.batching = batching
        self.stack = stack
        self.workers = workers
        self.devices = list(devices)
        self.stats = ModelStats(label, "1")
        self.pool: EnginePool | None = None
        self.batcher: Batcher | None = None

    async def start(self) -> None:
        """Load the function (in this process or in every worker) and start batching."""
        if self.workers == 0:
            config = _config(self.label, self.batching, self.devices[0], 1, {})
            engine = FunctionEngine(config, self.target, self.label, self.stack, self.devices[0])
            await asyncio.to_thread(engine.load)
            pool: EnginePool = ExecutorPool(engine, 1, self.label)
        else:
            params = {"target": self.target, "label": self.label, "stack": self.stack}
            pools = []
            groups = spread(self.workers, self.devices)
            for i, (device, count) in enumerate(groups):
                config = _config(self.label, self.batching, device, count, params)
                # The pool's engine is only read, never run: the workers load their own.
                front = PythonHandlerEngine(config, None, _cwd())
                spec = WorkerSpec(config, None, str(_cwd()))
                where = f"{self.label}@{device}" + (f"#{i}" if len(groups) > 1 else "")
                pools.append(ProcessPool(spec, front, count, where))
            pool = pools[0] if len(pools) == 1 else DevicePools(pools)
        await pool.start()
        self.pool = pool
        self.batcher = Batcher(self.label, self.batching, pool, self.stats)

    async def infer(
        self, inputs: dict[str, np.ndarray], shape_key: tuple[Any, ...], timeout_s: float
    ) -> dict[str, np.ndarray]:
        """Queue one call and wait for its row of the batch's outputs.

        Refusals (queue full, deadline unmeetable, closed) raise at once;
        cancelling the awaiting task takes the call out of the queue.
        """
        assert self.batcher is not None
        now = time.monotonic()
        future: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        req = InferenceRequest(inputs, 1, shape_key, now, now + timeout_s, future)
        self.batcher.submit(req)
        try:
            return await future
        except asyncio.CancelledError:
            self.batcher.forget(req)
            raise

    def snapshot(self) -> dict[str, Any]:
        """Statistics: the server's per-model document, plus the batch sizes run and workers."""
        b, pool = self.batcher, self.pool
        doc = self.stats.as_dict(b.pending if b else 0, b.running if b else 0)
        doc["batch_sizes"] = {
            size: s.compute_infer.count for size, s in sorted(self.stats.batch_sizes.items())
        }
        doc["restarts"] = pool.restarts if pool is not None else 0
        doc["worker_pids"] = list(pool.pids) if isinstance(pool, ChildProcesses) else []
        doc["live"] = pool.live if pool is not None else 0
        return doc

    async def stop(self) -> None:
        """Refuse new calls and answer the queued ones (unavailable); let running batches
        finish; stop the workers or the thread; unload the function."""
        if self.batcher is not None:
            self.batcher.close()
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.stop()
            await asyncio.to_thread(pool.engine.unload)


def _cwd() -> Path:
    # Handler imports in a worker put this folder on sys.path, as a config's folder is.
    return Path(os.getcwd())
