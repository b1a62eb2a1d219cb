"""Ray Serve serving a benchmark model (runs in the Ray venv).

    python bench/peers/apps/ray_app.py --workload tiny|minilm --port N [--max-wait-ms 5]

``@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)``, one replica,
``max_ongoing_requests=128`` (the default of 5 caps every batch at 5),
``ray.init(num_cpus=2, include_dashboard=False)``, access logs off
(shared/PEERS.md). Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

import common
import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse


def build(workload: str, max_batch: int, max_wait_s: float):
    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=128,
        ray_actor_options={"num_cpus": 1},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    )
    class Model:
        def __init__(self) -> None:
            common.set_threads()
            self.model = common.load(workload)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=max_wait_s)
        async def run(self, items: list) -> list:
            return list(common.run_batch(self.model, workload, items))

        async def __call__(self, request: Request) -> JSONResponse:
            item = common.parse_input(await request.json(), workload)
            row = await self.run(item)
            return JSONResponse(common.response_doc(workload, np.asarray(row)))

    return Model.bind()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["tiny", "minilm"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    args = p.parse_args()
    ray.init(
        num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
        _node_ip_address="127.0.0.1",  # every Ray process on loopback only
        runtime_env={"env_vars": {k: os.environ[k] for k in (
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "BENCH_MINILM_DIR",
            "BENCH_TORCH_THREADS", "HF_HUB_OFFLINE") if k in os.environ}},
    )  # fmt: skip
    serve.start(
        http_options={"host": "127.0.0.1", "port": args.port},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    )
    serve.run(build(args.workload, args.max_batch, args.max_wait_ms / 1e3), route_prefix="/infer")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    ray.shutdown()  # its processes go with it; serve.shutdown() first only adds seconds


if __name__ == "__main__":
    main()
