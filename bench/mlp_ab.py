"""The bench MLP at c=64 from two checkouts, interleaved, against the in-process ceiling.

    python -m bench.mlp_ab --baseline PATH [--rounds 3] [--duration 8] [--concurrency 64]

``PATH`` is another checkout of aserve (``git archive`` of the commit to
compare with). Each round measures the ceiling (``bench.ceiling``, batch 32,
its own process), then one point on each server in turn (each started from
its own tree, as ``bench.run`` configures the MLP: one instance, thread
executor, cpu_threads 1, max batch 32, preferred 8/16/32), so that a drift of
the machine's speed hits both. Prints one line per point: req/s, its ratio to
that round's ceiling, the mean batch and p99.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench.models import MODELS, default_cache_dir, model_file, sample_input
from bench.run import v2_body
from bench.servers import MODEL_ENV, ServerProcess, aserve_config

REPO = Path(__file__).resolve().parent.parent


def _ceiling(path: Path, features: int) -> float:
    argv = [sys.executable, "-m", "bench.ceiling", str(path), "--features", str(features),
            "--sizes", "32", "--seconds", "1.5"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["items_per_s"]["32"])


def _point(tree: Path, config: Path, body: Path, args: argparse.Namespace) -> dict[str, float]:
    server = ServerProcess("aserve", [sys.executable, "-m", "aserve", "--config", str(config),
                                      "--port", "0"], tree)  # fmt: skip
    try:
        url = f"{server.base_url}/v2/models/mlp/infer"
        argv = [sys.executable, "-m", "bench.loadgen", url, "--body", str(body),
                "-c", str(args.concurrency), "-d", str(args.duration), "-w", "2", "--json"]  # fmt: skip
        load = json.loads(subprocess.run(argv, capture_output=True, text=True, cwd=REPO,
                                         check=True).stdout)  # fmt: skip
        with urllib.request.urlopen(f"{server.base_url}/v2/models/mlp/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]
    finally:
        server.stop()
    return {"rps": load["rps"], "p99_ms": load["p99_ms"],
            "mean_batch": stats["inference_count"] / max(1, stats["execution_count"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mlp_ab", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    model = MODELS["mlp"]
    path = model_file(model, default_cache_dir())
    config = path.parent / "mlp-ab.json"
    config.write_text(json.dumps(aserve_config("mlp", path.name, model.features)))
    body = path.parent / "mlp-ab-body.json"
    body.write_bytes(v2_body(sample_input(model)))
    trees = {"baseline": args.baseline.resolve(), "this": REPO}
    ratios: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        ceiling = _ceiling(path, model.features)
        for name, tree in trees.items():
            r = _point(tree, config, body, args)
            ratios[name].append(r["rps"] / ceiling)
            print(f"round {round_} {name}: {r['rps']:.0f} req/s = {r['rps'] / ceiling:.3f} of "
                  f"the ceiling ({ceiling:.0f}/s at batch 32), mean batch {r['mean_batch']:.1f}, "
                  f"p99 {r['p99_ms']:.1f} ms, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.3f} of the ceiling "
              f"({min(values):.3f}-{max(values):.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
