"""LitServe serving a benchmark model (runs in the LitServe venv).

    python bench/peers/apps/litserve_app.py --workload tiny|minilm --port N [--max-wait-ms 5]

Batching as shared/PEERS.md sets it: ``LitAPI(max_batch_size=32,
batch_timeout=0.005)``, one worker on the CPU. ``--workload lm`` serves the
streaming decoder through LitServe's OpenAI spec (see ``lm_common.py``).
"""

from __future__ import annotations

import argparse

import common
import litserve as ls
import numpy as np


class BenchAPI(ls.LitAPI):
    def __init__(self, workload: str, **kwargs):
        super().__init__(**kwargs)
        self.workload = workload

    def setup(self, device):
        common.set_threads()
        self.model = common.load(self.workload)

    def decode_request(self, request):
        return common.parse_input(request, self.workload)

    def batch(self, inputs):
        return list(inputs)

    def predict(self, items):
        if not isinstance(items, list):  # max_batch_size 1: one item, not a list
            return common.run_batch(self.model, self.workload, [items])[0]
        return list(common.run_batch(self.model, self.workload, items))

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        return common.response_doc(self.workload, np.asarray(output))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["tiny", "minilm", "lm"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    args = p.parse_args()
    if args.workload == "lm":
        from lm_common import litserve_api

        api = litserve_api(args.max_batch, args.max_wait_ms / 1e3)
    else:
        api = BenchAPI(
            args.workload, max_batch_size=args.max_batch, batch_timeout=args.max_wait_ms / 1e3,
            api_path="/infer",
        )  # fmt: skip
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
