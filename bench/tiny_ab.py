"""The tiny model from two checkouts and the plain aiohttp handler, interleaved.

    python -m bench.tiny_ab --baseline PATH [--rounds 3] [--duration 6] [--concurrency 1,16,64]

``PATH`` is another checkout of aserve (``git archive`` of the commit to
compare with). Each round measures, at each concurrency, one point on each of
the three servers in turn (y = x + 1 on 16 floats, configured as ``bench.run``
does: one instance, cpu_threads 1, max batch 32, preferred 8/16/32), each
started fresh from its own tree, so that a drift of the machine's speed hits
all of them. ``--floor`` adds an aiohttp handler that answers a constant,
without parsing or a model: what any server on one aiohttp loop can reach
at most here. Prints one line per point (req/s, p50, p99, each as a ratio to the
plain handler's point of the same round) and the medians with their spread:
what issue 17's first target compares (c=1 p50 within 1.1x the plain
handler's, c=16 req/s at least the plain handler's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.models import MODELS, default_cache_dir, model_file, sample_input
from bench.run import v2_body
from bench.servers import MODEL_ENV, ServerProcess, aserve_config, start_plain

REPO = Path(__file__).resolve().parent.parent


def _load(server: ServerProcess, body: Path, c: int, args: argparse.Namespace) -> dict[str, float]:
    url = f"{server.base_url}/v2/models/tiny/infer"
    argv = [sys.executable, "-m", "bench.loadgen", url, "--body", str(body),
            "-c", str(c), "-d", str(args.duration), "-w", "1.5", "--json"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=True).stdout
    return json.loads(out)


def _point(name: str, tree: Path, config: Path, model: Path, body: Path, c: int,
           args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    if name == "plain":
        server = start_plain(model, "tiny", REPO)
    elif name == "floor":
        argv = [sys.executable, "-m", "bench.baseline_aiohttp", "--model", str(model),
                "--name", "tiny", "--port", "0", "--floor", str(body)]  # fmt: skip
        server = ServerProcess("aiohttp floor", argv, REPO)
    else:
        argv = [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"]
        server = ServerProcess(f"aserve ({name})", argv, tree)
    try:
        return _load(server, body, c, args)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tiny_ab", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the checkout to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--floor", action="store_true", help="also the aiohttp floor: an aiohttp "
                   "handler that answers a constant (python -m bench.baseline_aiohttp --floor)")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    bench_model = MODELS["tiny"]
    path = model_file(bench_model, default_cache_dir())
    config = path.parent / "tiny-ab.json"
    config.write_text(json.dumps(aserve_config("tiny", path.name, bench_model.features)))
    body = path.parent / "tiny-ab-body.json"
    body.write_bytes(v2_body(sample_input(bench_model)))
    trees = {"plain": REPO, "baseline": args.baseline.resolve(), "this": REPO}
    if args.floor:
        trees["floor"] = REPO
    levels = [int(c) for c in args.concurrency.split(",")]
    ratios: dict[tuple[str, int], dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for c in levels:
            points = {name: _point(name, tree, config, path, body, c, args)
                      for name, tree in trees.items()}  # fmt: skip
            plain = points["plain"]
            for name, r in points.items():
                got = ratios.setdefault((name, c), {"rps": [], "p50": [], "p99": []})
                got["rps"].append(r["rps"] / plain["rps"])
                got["p50"].append(r["p50_ms"] / plain["p50_ms"])
                got["p99"].append(r["p99_ms"] / plain["p99_ms"])
                print(f"round {round_} c={c} {name}: {r['rps']:.0f} req/s "
                      f"({r['rps'] / plain['rps']:.2f} of plain), p50 {r['p50_ms']:.3f} ms "
                      f"({r['p50_ms'] / plain['p50_ms']:.2f}x), p99 {r['p99_ms']:.3f} ms, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    print("medians over the rounds (min-max), as ratios to the plain handler:")
    for (name, c), got in ratios.items():
        if name == "plain":
            continue
        parts = [
            f"{k} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in got.items()
        ]
        print(f"c={c} {name}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
