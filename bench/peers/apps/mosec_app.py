"""Mosec serving a benchmark model (runs in the Mosec venv).

    python bench/peers/apps/mosec_app.py --workload tiny|minilm --port N [--max-wait-ms 5]

Mosec's Rust frontend takes the HTTP requests and batches them for one
Python worker process (``append_worker(num=1, max_batch_size=32,
max_wait_time=5)``, milliseconds; Mosec has no 0: below 1 it falls back to
its default of 10 ms, so there is no no-wait variant). Mosec does not speak
KServe V2: it serves one route, ``POST /inference``, and its default codec
decodes each body as JSON for ``forward`` and encodes what ``forward``
returns as JSON. So it gets the same request bytes as every server (the V2
JSON document, read as plain JSON, as the LitServe and Ray apps read it) and
answers the same V2-shaped JSON document (``common.response_doc``); neither
routes nor V2 validation are Mosec's. Logging at warning, 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os

import common
from mosec import Server, Worker


class BenchWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        common.set_threads()
        self.workload = os.environ["BENCH_WORKLOAD"]
        self.model = common.load(self.workload)

    def forward(self, data):
        single = not isinstance(data, list)  # max_batch_size 1: one item, not a list
        docs = [data] if single else data
        items = [common.parse_input(d, self.workload) for d in docs]
        rows = common.run_batch(self.model, self.workload, items)
        out = [common.response_doc(self.workload, r) for r in rows]
        return out[0] if single else out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["tiny", "minilm"])
    p.add_argument("--port", type=int, required=True)  # read by Mosec as well
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    # The rest (--address, --log-level, ...) are Mosec's own: it parses sys.argv itself.
    args, _ = p.parse_known_args()
    # The worker is a spawned process: it reads the workload from the environment.
    os.environ["BENCH_WORKLOAD"] = args.workload
    server = Server()
    server.append_worker(
        BenchWorker, num=1, max_batch_size=args.max_batch,
        max_wait_time=max(1, round(args.max_wait_ms)),
    )  # fmt: skip
    server.run()


if __name__ == "__main__":
    main()
