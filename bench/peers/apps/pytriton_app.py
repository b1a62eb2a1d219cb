"""Triton (through PyTriton) serving a benchmark model (runs in the PyTriton venv).

    python bench/peers/apps/pytriton_app.py --workload tiny|minilm --port N [--max-wait-ms 5]

Triton's dynamic batcher: ``max_batch_size`` 32, ``max_queue_delay_microseconds``
5000 (0 for the no-wait variant). Triton speaks KServe V2 itself, so the
request body is the one every server gets, at ``/v2/models/NAME/infer``.
Triton's gRPC and metrics ports are bound to loopback as well.
"""

from __future__ import annotations

import argparse

import common
import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["tiny", "minilm"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    args = p.parse_args()
    common.set_threads()
    workload = args.workload
    model = common.load(workload)
    in_name, out_name = common.NAMES[workload]

    @batch
    def infer(**inputs):
        x = inputs[in_name]
        if workload == "tiny":
            items = list(x)
        else:
            items = [v[0].decode() if isinstance(v[0], bytes) else str(v[0]) for v in x]
        return {out_name: np.asarray(common.run_batch(model, workload, items), np.float32)}

    if workload == "tiny":
        inputs = [Tensor(name=in_name, dtype=np.float32, shape=(common.TINY_FEATURES,))]
        outputs = [Tensor(name=out_name, dtype=np.float32, shape=(common.TINY_FEATURES,))]
    else:
        inputs = [Tensor(name=in_name, dtype=bytes, shape=(1,))]
        outputs = [Tensor(name=out_name, dtype=np.float32, shape=(common.MINILM_DIM,))]
    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.port,
        grpc_address="127.0.0.1", grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, log_verbose=0,
    )  # fmt: skip
    batcher = DynamicBatcher(max_queue_delay_microseconds=int(args.max_wait_ms * 1000))
    with Triton(config=config) as triton:
        triton.bind(
            model_name=workload, infer_func=infer, inputs=inputs, outputs=outputs,
            config=ModelConfig(max_batch_size=args.max_batch, batcher=batcher),
            strict=False,
        )  # fmt: skip
        triton.serve()


if __name__ == "__main__":
    main()
