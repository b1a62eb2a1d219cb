"""The throughput part of ``bench/gpu_check.sh``: the bench MLP on a GPU, through aserve.

    python -m bench.gpu_bench --out FILE.json [--duration 5] [--warmup 1] [--concurrency 64]

Rows, each one server under ``bench.loadgen`` (in this process) at the given
concurrency, answers checked against the TorchScript model:

- the in-process ceiling on cuda:0 (host array in, host array out, per call);
- engine torch on cuda:0 with 1, 2 and 4 instances (one CUDA stream each),
  and 2 instances with ``cuda_graphs``;
- engine onnx on cuda:0, when onnxruntime has its CUDA provider;
- engine tensorrt on cuda:0 (fp32 and fp16, built from the ONNX export),
  when TensorRT and cuda-python are installed.

Without a GPU it runs the CPU rows only (torch and onnx, one instance) as a
smoke test of the harness. Every row it does not run is listed with the
reason under ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.models import MODELS, default_cache_dir, expected_output, model_file, sample_input
from bench.onnx_row import SIZES, onnx_file, serve_point


def cuda_ceiling(pt_path: Path, features: int, seconds: float) -> dict[str, Any]:
    """Best items/s of the TorchScript MLP on cuda:0, host to host, one stream."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(pt_path), map_location="cuda:0").eval()
    items = {}
    with torch.inference_mode():
        for size in SIZES:
            x = np.random.default_rng(size).standard_normal((size, features)).astype(np.float32)
            for _ in range(5):
                module(torch.from_numpy(x).cuda()).cpu()
            calls, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                module(torch.from_numpy(x).cuda()).cpu().numpy()
                calls += 1
            items[str(size)] = calls * size / (time.perf_counter() - t0)
    best = max(items, key=lambda k: items[k])
    return {"items_per_s": items, "best_batch_size": int(best), "best_items_per_s": items[best]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_bench")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--ceiling-seconds", type=float, default=0.5)
    p.add_argument("--md", type=Path, help="also write the Markdown report here")
    p.add_argument("--tests-log", type=Path, help="pytest -m gpu output, quoted in the report")
    p.add_argument("--facts", type=Path, help="text about the machine, quoted in the report")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    cache = default_cache_dir()
    mlp = MODELS["mlp"]
    pt = model_file(mlp, cache)
    expected = expected_output(pt, sample_input(mlp))
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    results: dict[str, Any] = {
        "mode": "gpu" if cuda else "cpu",
        "device": torch.cuda.get_device_name(0) if cuda else "none (CPU only)",
        "torch": torch.__version__,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rows": rows,
        "skipped": skipped,
    }

    def point(label: str, engine: str, path: Path, **fields: Any) -> None:
        t0 = time.perf_counter()
        try:
            r = serve_point(engine, path, expected, args, label=label, **fields)
        except Exception as exc:  # one failed row must not hide the others
            traceback.print_exc()
            rows.append({"label": label, "error": f"{type(exc).__name__}: {exc}"[:500]})
            return
        r["label"], r["wall_s"] = label, round(time.perf_counter() - t0, 1)
        rows.append(r)

    try:
        onnx_path: Path | None = onnx_file(pt, mlp.features)
    except Exception as exc:
        onnx_path = None
        skipped.append(f"every onnx/tensorrt row: the ONNX export failed ({exc})")

    if cuda:
        results["ceiling"] = cuda_ceiling(pt, mlp.features, args.ceiling_seconds)
        print(f"  ceiling cuda:0 {results['ceiling']['best_items_per_s']:.0f} items/s",
              file=sys.stderr, flush=True)  # fmt: skip
        for n in (1, 2, 4):
            point(f"torch cuda:0 x{n}", "torch", pt, device="cuda:0", instances=n)
        point("torch cuda:0 x2 graphs", "torch", pt, device="cuda:0", instances=2, cuda_graphs=True)
    else:
        skipped.append("torch on cuda:0 (1/2/4 instances, CUDA graphs): no CUDA device")
        point("torch cpu x1 (smoke)", "torch", pt)

    providers: list[str] = []
    try:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
        results["onnxruntime"] = f"{onnxruntime.__version__} ({', '.join(providers)})"
    except ImportError:
        skipped.append("onnx rows: onnxruntime is not installed")
    if onnx_path is not None and providers:
        if cuda and "CUDAExecutionProvider" in providers:
            point("onnx cuda:0 x2", "onnx", onnx_path, device="cuda:0", instances=2)
        else:
            why = "no CUDA device" if not cuda else "this onnxruntime has no CUDAExecutionProvider"
            skipped.append(f"onnx on cuda:0: {why}")
            point("onnx cpu x1 (smoke)", "onnx", onnx_path)

    from aserve.engines.requirements import engine_problem

    problem = engine_problem("tensorrt", "cuda:0")
    if problem is not None:
        skipped.append(f"tensorrt rows: {problem}")
    elif onnx_path is not None:
        os.environ.setdefault("ASERVE_CACHE_DIR", str(cache / "aserve-cache"))
        for precision in ("fp32", "fp16"):
            point(
                f"tensorrt {precision} x2", "tensorrt", onnx_path,
                device="cuda:0", instances=2, precision=precision,
            )  # fmt: skip

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        tests = args.tests_log.read_text() if args.tests_log and args.tests_log.is_file() else ""
        facts = args.facts.read_text() if args.facts and args.facts.is_file() else ""
        args.md.write_text(render(results, tests, facts))
    return 0


def render(results: dict[str, Any], tests_log: str, facts: str) -> str:
    """The report: machine, GPU tests, throughput table, what was skipped and why."""
    mode = results["mode"]
    lines = [
        f"# aserve GPU check ({'GPU' if mode == 'gpu' else 'CPU-only mode: no GPU was found'})",
        "",
        f"Written by `bench/gpu_check.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Device: {results['device']}; torch {results['torch']}; "
        f"onnxruntime {results.get('onnxruntime', 'not installed')}.",
        "",
    ]
    if facts.strip():
        lines += ["## Machine", "", "```", facts.strip(), "```", ""]
    if tests_log.strip():
        tail = tests_log.strip().splitlines()[-40:]
        lines += ["## GPU tests (`pytest -m gpu -rs`)", "", "```", *tail, "```", ""]
    lines += [
        f"## The bench MLP through aserve (bench.loadgen, c={results['concurrency']}, "
        f"{results['duration_s']} s per row)",
        "",
    ]
    ceiling = results.get("ceiling")
    if ceiling:
        per_size = ", ".join(f"{k}: {v:.0f}" for k, v in ceiling["items_per_s"].items())
        lines += [
            f"In-process ceiling on cuda:0 (host to host, one stream): best "
            f"{ceiling['best_items_per_s']:.0f} items/s at batch {ceiling['best_batch_size']} "
            f"({per_size}).",
            "",
        ]
    lines += [
        "| row | req/s | p50 ms | p99 ms | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['mean_batch']:.1f} | {r['errors']} |"
        )
    lines += ["", "## Skipped", ""]
    lines += [f"- {s}" for s in results["skipped"]] or ["- nothing"]
    engine_logs = [
        f"- {r['label']}: {line}" for r in results["rows"] for line in r.get("server_log", [])
    ]
    if engine_logs:
        lines += ["", "## Engine log lines", "", *engine_logs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
