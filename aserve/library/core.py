"""The loop side of a ``Batched``: the batched runtime of its function.

Everything here runs on the event loop the ``Batched`` was started on (its
own thread's, or the caller's); :mod:`aserve.library.batched` hands calls
over with ``run_coroutine_threadsafe``. :class:`Core` is a
:class:`~aserve.loop.runtimes.batched.ModelRuntime`, the server's batched
runtime, loaded, asked and unloaded through the same
:class:`~aserve.loop.runtimes.base.Runtime` contract: the same
:class:`aserve.loop.batcher.Batcher` queues the calls by deadline and cuts
batches from its latency model. What it brings is the function's engine and
where it runs: an :class:`aserve.workers.thread_pool.ExecutorPool` (the
function in this process, on one executor thread), or worker processes
spread over devices (:mod:`aserve.library.pools`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aserve.config import BatchingConfig, ModelConfig, TensorSpec
from aserve.engines.base import Engine
from aserve.engines.python_handler import PythonHandlerEngine
from aserve.library.pools import DevicePools, spread
from aserve.library.runner import FunctionEngine
from aserve.loop.runtimes.base import ModelState
from aserve.loop.runtimes.batched import ModelRuntime
from aserve.obs.stats import ModelStats
from aserve.workers.batch_process import ProcessPool, WorkerSpec
from aserve.workers.job import EnginePool

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


class Core(ModelRuntime):
    """One ``Batched``'s serving machinery, on its loop: ``load``, ``infer`` (one call
    as a request of one item), ``unload``, and :meth:`snapshot` for its statistics.

    Its config is the first device's (``workers`` spread over ``devices``, as
    :func:`~aserve.library.pools.spread` says); ``label``, the ``Batched``'s
    name as given, names it in messages, statistics and threads.
    """

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
        self.stack = stack
        self.workers = workers
        self.devices = list(devices)
        self._params = {"target": target, "label": label, "stack": stack} if workers else {}
        device, count = spread(workers, self.devices)[0] if workers else (self.devices[0], 1)
        super().__init__(
            _config(label, batching, device, count, self._params),
            Path(os.curdir),  # unread: the function has no files; workers get the cwd
            engine=self._engine,
            pool=self._worker_pools if workers else None,
        )
        self.name = self.label = label
        self.stats = ModelStats(label, "1")

    async def load(self) -> None:
        """Load the function (in this process or in every worker) and start batching.

        No warm-up: a user's function is never called with made-up inputs.
        """
        await self.start()
        self.state = ModelState.READY

    def not_ready_reason(self) -> str | None:
        """None: every call goes to the batcher, which queues it while a worker
        restarts (where a server's model refuses it) and refuses it once closed."""
        return None

    def _engine(self, path: Path | None) -> Engine:
        if not self.workers:
            return FunctionEngine(self.config, self.target, self.label, self.stack, self.devices[0])
        # The worker pools' engine is only read, never run: the workers load their own.
        return PythonHandlerEngine(self.config, None, _cwd())

    def _worker_pools(self, front: Engine) -> EnginePool:
        """A worker pool per device the workers are spread over, as one pool."""
        pools = []
        groups = spread(self.workers, self.devices)
        for i, (device, count) in enumerate(groups):
            config = _config(self.label, self.config.batching, device, count, self._params)
            spec = WorkerSpec(config, None, str(_cwd()))
            where = f"{self.label}@{device}" + (f"#{i}" if len(groups) > 1 else "")
            pools.append(ProcessPool(spec, front, count, where))
        return pools[0] if len(pools) == 1 else DevicePools(pools)

    def snapshot(self) -> dict[str, Any]:
        """Statistics: the server's per-model document, plus the batch sizes run and workers."""
        b, pool = self.batcher, self._pool
        doc = self.stats.as_dict(b.pending if b else 0, b.running if b else 0)
        doc["batch_sizes"] = {
            size: s.compute_infer.count for size, s in sorted(self.stats.batch_sizes.items())
        }
        doc["restarts"] = pool.restarts if pool is not None else 0
        doc["worker_pids"] = self.worker_pids
        doc["live"] = pool.live if pool is not None else 0
        return doc


def _cwd() -> Path:
    # Handler imports in a worker put this folder on sys.path, as a config's folder is.
    return Path(os.getcwd())
