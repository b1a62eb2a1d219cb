"""The ONNX row: the bench MLP through aserve with engine torch vs. engine onnx.

    python -m bench.onnx_row [--duration 10] [--warmup 2] [--concurrency 64]

The same MLP (``bench.models`` "mlp": 64 -> 4 x 4096 -> 64, seeded) is saved
as TorchScript and exported to ONNX (dynamo exporter, dynamic batch; cached
beside the TorchScript file). For each engine:

1. the in-process ceiling: the model called in a tight loop on one thread at
   batch sizes 1..32 (torch: the TorchScript module; onnx: an onnxruntime
   session with one intra-op thread), best items/s;
2. aserve serving it (one instance, ``cpu_threads`` 1, the bench's batching
   settings) under ``--concurrency`` closed-loop connections of
   ``bench.loadgen``, run in this process; the first answer is checked
   against the TorchScript model's own output.

Writes ``RESULTS-onnx.md`` (and ``results-onnx.json``) into ``--out-dir``
(default: bench/). One server at a time; nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import loadgen
from bench.ceiling import measure
from bench.models import MODELS, default_cache_dir, expected_output, model_file, sample_input
from bench.report import cpu_model
from bench.servers import MODEL_ENV, aserve_config, start_aserve

REPO = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 4, 8, 16, 32)


def onnx_file(pt_path: Path, features: int) -> Path:
    """The MLP exported to ONNX beside its TorchScript file (built once)."""
    path = pt_path.with_suffix(".onnx")
    if path.is_file():
        return path
    module = MODELS["mlp"].build().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, (torch.randn(2, features),), input_names=["INPUT0"],
            output_names=["OUTPUT0"], dynamic_shapes=({0: batch},), dynamo=True,
        )  # fmt: skip
        # Weights stay inside the file below 2 GB (else beside it, as mlp-*.onnx.data).
        program.save(str(path))
    return path


def ceiling_torch(pt_path: Path, features: int, seconds: float) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(pt_path), map_location="cpu").eval()
    items = {str(s): measure(module, features, s, seconds)[0] for s in SIZES}
    return _best(items)


def ceiling_onnx(onnx_path: Path, features: int, seconds: float) -> dict[str, Any]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    items = {}
    for size in SIZES:
        x = np.random.default_rng(size).standard_normal((size, features)).astype(np.float32)
        feed = {"INPUT0": x}
        for _ in range(3):
            session.run(None, feed)
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            session.run(None, feed)
            calls += 1
        items[str(size)] = calls * size / (time.perf_counter() - t0)
    return _best(items)


def _best(items: dict[str, float]) -> dict[str, Any]:
    best = max(items, key=lambda k: items[k])
    return {"items_per_s": items, "best_batch_size": int(best), "best_items_per_s": items[best]}


def v2_body(values: list[float]) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                       "data": values}]}  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


async def _drive(url: str, body: bytes, expected: list[float], args: argparse.Namespace):
    status, reply = await loadgen.fetch_once(url, body)
    if status != 200:
        raise RuntimeError(f"first request answered {status}: {reply[:300]!r}")
    loadgen.check_outputs(reply, expected, rtol=1e-3, atol=1e-4)
    return await loadgen.run_load(url, body, args.concurrency, args.duration, args.warmup)


def serve_point(
    engine: str,
    model_path: Path,
    expected: list[float],
    args: argparse.Namespace,
    label: str | None = None,
    **model_fields: Any,
) -> dict[str, Any]:
    """aserve serving ``model_path`` with ``engine`` (plus ``model_fields``) under load."""
    label = label or engine
    config = aserve_config("mlp", model_path.name, MODELS["mlp"].features)
    config["models"][0].update(engine=engine, **model_fields)
    cfg_path = model_path.parent / f"mlp-{label}-point.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    body = v2_body(sample_input(MODELS["mlp"]))
    with start_aserve(cfg_path, REPO) as server:
        url = f"{server.base_url}/v2/models/mlp/infer"
        stats_url = f"{server.base_url}/v2/models/mlp/stats"
        before = _get_json(stats_url)
        result = asyncio.run(_drive(url, body, expected, args))
        after = _get_json(stats_url)
        log_tail = server.log_tail(200)
    out = result.as_dict()
    b, a = (s["model_stats"][0] for s in (before, after))
    out["batches"] = a["execution_count"] - b["execution_count"]
    out["mean_batch"] = (a["inference_count"] - b["inference_count"]) / max(out["batches"], 1)
    out["server_log"] = [line for line in log_tail.splitlines() if "aserve.engines" in line]
    print(
        f"  aserve {label:18s} c={args.concurrency}: {out['rps']:.1f} req/s, "
        f"p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, mean batch "
        f"{out['mean_batch']:.1f}, errors {out['errors']}",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return out


def _get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def render(results: dict[str, Any]) -> str:
    f = results["facts"]
    lines = [
        "# ONNX row: the bench MLP, engine torch vs. engine onnx",
        "",
        f"Generated by `{f['command']}` on {f['date']} ({f['cpu']}, {f['cores']} cores; "
        f"torch {f['torch']}, onnxruntime {f['onnxruntime']}). Model: {results['model']}. "
        f"aserve: one instance, cpu_threads 1, max_batch_size 32, preferred 8/16/32; "
        f"load: bench.loadgen in-process, c={results['concurrency']}, "
        f"{results['duration_s']} s measured after {results['warmup_s']} s warm-up.",
        "",
        "| engine | ceiling, best items/s (batch) | aserve req/s at c="
        f"{results['concurrency']} | p50 ms | p99 ms | mean batch | aserve / own ceiling |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for engine in ("torch", "onnx"):
        c, s = results["ceiling"][engine], results["aserve"][engine]
        lines.append(
            f"| {engine} | {c['best_items_per_s']:.0f} ({c['best_batch_size']}) | {s['rps']:.0f} | "
            f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['mean_batch']:.1f} | "
            f"{s['rps'] / c['best_items_per_s']:.2f} |"
        )
    lines += [
        "",
        "Ceiling items/s by batch size:",
        "",
        "| engine | " + " | ".join(str(s) for s in SIZES) + " |",
        "|---|" + "---:|" * len(SIZES),
    ]
    for engine in ("torch", "onnx"):
        items = results["ceiling"][engine]["items_per_s"]
        lines.append(f"| {engine} | " + " | ".join(f"{items[str(s)]:.0f}" for s in SIZES) + " |")
    ratio = results["aserve"]["onnx"]["rps"] / results["aserve"]["torch"]["rps"]
    lines += [
        "",
        f"aserve onnx / aserve torch at c={results['concurrency']}: **{ratio:.2f}x**",
        "",
        "The load generator runs in the same process as this script, on the same cores as the "
        "server, and the ceilings were measured with nothing else running: on a small machine "
        "the last column is a lower bound of what the server itself achieves.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.onnx_row", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per engine")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--ceiling-seconds", type=float, default=1.0, help="timed seconds per size")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    torch.set_num_threads(1)
    import onnxruntime

    cache = args.cache_dir or default_cache_dir()
    pt = model_file(MODELS["mlp"], cache)
    onnx_path = onnx_file(pt, MODELS["mlp"].features)
    expected = expected_output(pt, sample_input(MODELS["mlp"]))
    features = MODELS["mlp"].features
    print("onnx_row: in-process ceilings", file=sys.stderr, flush=True)
    ceiling = {
        "torch": ceiling_torch(pt, features, args.ceiling_seconds),
        "onnx": ceiling_onnx(onnx_path, features, args.ceiling_seconds),
    }
    for engine, c in ceiling.items():
        print(f"  ceiling {engine}: {c['best_items_per_s']:.0f} items/s at batch "
              f"{c['best_batch_size']}", file=sys.stderr, flush=True)  # fmt: skip
    served = {
        "torch": serve_point("torch", pt, expected, args),
        "onnx": serve_point("onnx", onnx_path, expected, args),
    }
    results = {
        "facts": {
            "command": " ".join(["python -m bench.onnx_row", *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "model": MODELS["mlp"].description,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "ceiling": ceiling,
        "aserve": served,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results-onnx.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out_dir / "RESULTS-onnx.md").write_text(render(results))
    print(f"onnx_row: wrote {args.out_dir / 'RESULTS-onnx.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
