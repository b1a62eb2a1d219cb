"""What aserve's own code spends on one refused request, without the HTTP server around it.

    python -m bench.refusal_cost [--n 20000]

Times, per call, the three steps of a refusal that are aserve's: decoding the
MLP's request body (``decode_request``), the admission check that refuses it
(``Batcher.check_admission`` raising ``Unavailable``) and the error response
(``error_response``: orjson, no traceback, no log line). The rest of a
refusal's cost (aiohttp's parsing and response objects, the socket write and
the kernel's loopback) is what ``bench.storm`` measures on the server's pid.
Prints one JSON object (microseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from aserve.codecs.v2 import decode_request
from aserve.config import BatchingConfig, TensorSpec
from aserve.errors import Unavailable
from aserve.frontends.http.kit import error_response
from aserve.loop.batcher import Batcher
from aserve.loop.loop_lag import LoopLag
from aserve.obs.stats import ModelStats
from bench.models import MODELS, sample_input


class _Pool:
    instances = 1

    def submit(self, job: Any) -> None:  # never reached: every request is refused
        raise AssertionError("admitted")


async def _measure(n: int) -> dict[str, float]:
    item = {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32",
            "data": sample_input(MODELS["mlp"])}  # fmt: skip
    body = json.dumps({"inputs": [item]}).encode()
    specs = {"INPUT0": TensorSpec(name="INPUT0", datatype="FP32", shape=[64])}
    outs = {"OUTPUT0": TensorSpec(name="OUTPUT0", datatype="FP32", shape=[64])}
    t0 = time.perf_counter()
    for _ in range(n):
        decode_request(body, None, "mlp", specs, outs, 32, False)
    decode = (time.perf_counter() - t0) / n
    batcher = Batcher("mlp/1", BatchingConfig(max_batch_size=32), _Pool(),  # type: ignore[arg-type]
                      ModelStats("mlp", "1"), loop_lag=LoopLag())  # fmt: skip
    batcher.latency.observe(1, 0.013)
    batcher.latency.observe(32, 0.057)
    error: Unavailable | None = None
    t0 = time.perf_counter()
    for _ in range(n):
        now = time.monotonic()
        try:
            batcher.check_admission(now, now + 0.001, 1)
        except Unavailable as exc:
            error = exc
    admission = (time.perf_counter() - t0) / n
    assert error is not None
    t0 = time.perf_counter()
    for _ in range(n):
        error_response(error)
    respond = (time.perf_counter() - t0) / n
    return {"decode_us": decode * 1e6, "admission_us": admission * 1e6,
            "error_response_us": respond * 1e6,
            "total_us": (decode + admission + respond) * 1e6}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refusal_cost")
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_measure(args.n))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
