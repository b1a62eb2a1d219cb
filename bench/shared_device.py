"""Many models on one device: a shared device scheduler against independent instances.

Eight small CPU models (TorchScript MLPs of different widths, sized on the
machine that runs the bench to 2-10 ms a batch of 8 on one thread) are
served by one aserve on one core (``taskset``), twice:

- ``independent``: today's default, each model its own instance thread, all
  eight contending for the core whenever they have a batch;
- ``shared``: ``"devices": {"cpu": {"scheduling": "shared", "slots": 1}}``:
  one batch at a time, the slot going to the most urgent one.

Traffic is open loop, Zipf(1.0) over the models (model k gets 1/k of it), at
0.8x and 1.2x of the capacity measured first (the shared server's best
goodput over a sweep of rates); models 1, 3, 5, 7 (by rank) have a 50 ms
deadline, 2, 4, 6, 8 500 ms, set as each model's ``batching.timeout_ms`` and
kept by the client too (a request not answered by then is given up, late).
Reported per mode, rate and class: goodput (answers in time per second),
the share of admitted requests answered in time, p99 of those in time.

    python -m bench.shared_device [--duration 10] [--out bench/RESULTS-shared-device.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.loadgen import run_open_loop
from bench.peers.launch import Plan, Running, free_port

REPO = Path(__file__).resolve().parent.parent
# By rank, the hottest first: a batch of 8's time on one thread, what the widths
# are sized to on the machine that runs the bench (a fixed width is 2-15 ms on
# one machine and 1-7 ms on a faster one, where the event loop's share of the
# core, not the models, decides what is measured).
TARGET_BATCH_MS = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.5, 10.0]
PROBE_WIDTH = 2048
MAX_WIDTH = 16384
FEATURES = 64
DEADLINES_MS = [50.0 if k % 2 == 0 else 500.0 for k in range(len(TARGET_BATCH_MS))]
SERVER_CORE, CLIENT_CORE = "1", "0"


def _build(width: int, folder: Path) -> Path:
    torch.manual_seed(width)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, FEATURES),
    ).eval()  # fmt: skip
    path = folder / f"mlp{width}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(net).save(str(path))
    return path


def _widths(targets_ms: list[float], folder: Path, device: str) -> list[int]:
    """The widths whose batch of 8 takes about each of ``targets_ms`` here, as
    multiples of 64: the time grows as the width squared (the middle layer
    dominates), scaled from one probe's."""
    probe_ms = _in_process_ms(_build(PROBE_WIDTH, folder), 8, device)
    # On a GPU a small MLP's batch is mostly launch latency: the width is capped
    # (16384: 1 GiB of weights), whatever time that gives.
    return [
        min(MAX_WIDTH, max(64, round(PROBE_WIDTH * (t / probe_ms) ** 0.5 / 64) * 64))
        for t in targets_ms
    ]


def _in_process_ms(path: Path, batch: int, device: str = "cpu", reps: int = 30) -> float:
    """The model's own time for a batch, one thread, as the server runs it."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.jit.load(str(path), map_location=device).eval()
    x = torch.zeros(batch, FEATURES, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    with torch.inference_mode():
        for _ in range(5):
            m(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            m(x)
        sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _config(folder: Path, port: int, shared: bool, widths: list[int], device: str) -> Path:
    models = []
    for k, width in enumerate(widths):
        models.append({
            "name": f"m{k + 1}", "engine": "torch", "path": f"mlp{width}.pt", "cpu_threads": 1,
            "device": device,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [FEATURES]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [FEATURES]}],
            "batching": {"max_batch_size": 8, "max_delay_ms": 2.0, "timeout_ms": DEADLINES_MS[k]},
        })  # fmt: skip
    config: dict[str, Any] = {"http": {"host": "127.0.0.1", "port": port}, "models": models}
    if shared:
        config["devices"] = {device: {"scheduling": "shared", "slots": 1}}
    path = folder / ("shared.json" if shared else "independent.json")
    path.write_text(json.dumps(config, indent=2))
    return path


def _body(priority: int = 0) -> bytes:
    doc: dict[str, Any] = {"inputs": [{"name": "INPUT0", "datatype": "FP32",
                                       "shape": [1, FEATURES], "data": [0.5] * FEATURES}]}  # fmt: skip
    if priority:
        doc["parameters"] = {"priority": priority}
    return json.dumps(doc).encode()


def _weights() -> list[float]:
    raw = [1.0 / (k + 1) for k in range(len(TARGET_BATCH_MS))]
    return [w / sum(raw) for w in raw]


async def _traffic(base: str, rate: float, duration_s: float) -> list[dict[str, Any]]:
    """Open loop over every model at once, Zipf-weighted; one result per model."""
    body = _body()
    runs = [
        run_open_loop(f"{base}/v2/models/m{k + 1}/infer", body, rate * w, duration_s,
                      warmup_s=2.0, deadline_ms=DEADLINES_MS[k], max_connections=512)
        for k, w in enumerate(_weights())
    ]  # fmt: skip
    return [r.as_dict() for r in await asyncio.gather(*runs)]


def _classes(per_model: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for deadline in sorted(set(DEADLINES_MS)):
        rows = [r for k, r in enumerate(per_model) if DEADLINES_MS[k] == deadline]
        ok = sum(r["ok_in_time"] for r in rows)
        admitted = sum(r["admitted"] for r in rows)
        out[f"{deadline:.0f}ms"] = {
            "goodput_rps": ok / duration_s,
            "offered": sum(r["sent"] + r["not_sent"] for r in rows),
            "admitted": admitted,
            "refused": sum(r["refused"] for r in rows),
            "late": sum(r["late"] for r in rows),
            "admitted_in_time": ok / admitted if admitted else None,
            # The worst model's p99 in the class (a class's p99 from per-model ones).
            "p99_ms": max((r["p99_ms"] for r in rows if r["ok_in_time"]), default=None),
        }
    out["goodput_rps"] = sum(c["goodput_rps"] for c in out.values())
    return out


def _serve(folder: Path, shared: bool, widths: list[int], device: str) -> Running:
    port = free_port()
    cfg = _config(folder, port, shared, widths, device)
    argv = ["taskset", "-c", SERVER_CORE, sys.executable, "-m", "aserve", "--config", str(cfg),
            "--log-level", "WARNING"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    plan = Plan("shared" if shared else "independent", argv, f"{base}/v2/models/m8/infer",
                cwd=REPO, start_timeout_s=300)  # fmt: skip
    return Running(plan, _body(), folder / f"{plan.label}.log")


def run(
    duration_s: float, folder: Path, only_priority: bool = False, device: str = "cpu"
) -> dict[str, Any]:
    if only_priority:
        os.sched_setaffinity(0, {int(CLIENT_CORE)})
        return {"priority": _priority(folder, duration_s, device)}
    widths = _widths(TARGET_BATCH_MS, folder, device)
    paths = [_build(w, folder) for w in widths]
    batch_ms = {f"m{k + 1}": {b: round(_in_process_ms(p, b, device), 2) for b in (1, 8)}
                for k, p in enumerate(paths)}  # fmt: skip
    os.sched_setaffinity(0, {int(CLIENT_CORE)})
    results: dict[str, Any] = {
        "device": device, "batch_ms": batch_ms, "widths": widths, "duration_s": duration_s,
    }  # fmt: skip
    mean_1 = sum(w * batch_ms[f"m{k + 1}"][1] for k, w in enumerate(_weights())) / 1e3
    base_rate = 1.0 / mean_1  # one request per batch: no batching at all
    with _serve(folder, True, widths, device) as srv:
        base = srv.plan.url.rsplit("/v2/", 1)[0]
        sweep = {}
        for factor in (0.25, 0.5, 0.75, 1.0, 1.5):
            per = asyncio.run(_traffic(base, base_rate * factor, 4.0))
            sweep[round(base_rate * factor)] = _classes(per, 4.0)["goodput_rps"]
    capacity = max(sweep.values())
    results["capacity"] = {"unbatched_rps": base_rate, "sweep": sweep, "capacity_rps": capacity}
    for shared in (False, True):
        mode = "shared" if shared else "independent"
        with _serve(folder, shared, widths, device) as srv:
            base = srv.plan.url.rsplit("/v2/", 1)[0]
            for factor in (0.8, 1.2):
                per = asyncio.run(_traffic(base, capacity * factor, duration_s))
                results[f"{mode}@{factor}"] = _classes(per, duration_s)
    results["priority"] = _priority(folder, duration_s, device)
    return results


PRIORITY_DEADLINE_MS = 300.0
# The priority run's model: heavier (a batch of 8 in about 40 ms), so that what
# is measured is the batcher's order, not the event loop's cost of refusing 3x
# its capacity (with a 25 ms batch on a fast machine, 1,600 requests a second
# made the loop, and the load generator beside it, the bottleneck); the server
# gets both cores there (the model thread one, the loop the other).
PRIORITY_BATCH_MS = 40.0


def _priority_config(folder: Path, port: int, width: int, device: str) -> Path:
    model = {
        "name": "p", "engine": "torch", "path": f"mlp{width}.pt", "cpu_threads": 1,
        "device": device,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [FEATURES]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [FEATURES]}],
        "batching": {"max_batch_size": 8, "max_delay_ms": 2.0, "timeout_ms": PRIORITY_DEADLINE_MS,
                     "priority_levels": 2, "default_priority_level": 2},
    }  # fmt: skip
    path = folder / "priority.json"
    path.write_text(json.dumps({"http": {"host": "127.0.0.1", "port": port}, "models": [model]}))
    return path


def _priority(folder: Path, duration_s: float, device: str) -> dict[str, Any]:
    """One model with two levels: its capacity (low priority alone, the best goodput
    of a sweep), then level 1 at 0.3x of it beside level 2 at 3x."""
    [width] = _widths([PRIORITY_BATCH_MS], folder, device)
    batch_ms = _in_process_ms(_build(width, folder), 8, device)
    port = free_port()
    cfg = _priority_config(folder, port, width, device)
    argv = [sys.executable, "-m", "aserve", "--config", str(cfg), "--log-level", "WARNING"]
    url = f"http://127.0.0.1:{port}/v2/models/p/infer"
    plan = Plan("priority", argv, url, cwd=REPO, start_timeout_s=300)
    out: dict[str, Any] = {
        "deadline_ms": PRIORITY_DEADLINE_MS, "width": width, "batch_8_ms": round(batch_ms, 1),
    }  # fmt: skip
    with Running(plan, _body(), folder / "priority.log"):
        sweep = {}
        for rate in (100, 200, 300, 400, 500, 600):
            r = asyncio.run(run_open_loop(url, _body(2), rate, 4.0, warmup_s=1.0,
                                          deadline_ms=PRIORITY_DEADLINE_MS))  # fmt: skip
            sweep[rate] = r.goodput_rps
        capacity = max(sweep.values())
        out["capacity"] = {"sweep": sweep, "capacity_rps": capacity}

        async def both() -> list[Any]:
            return list(await asyncio.gather(
                run_open_loop(url, _body(1), 0.3 * capacity, duration_s, warmup_s=2.0,
                              deadline_ms=PRIORITY_DEADLINE_MS),
                run_open_loop(url, _body(2), 3.0 * capacity, duration_s, warmup_s=2.0,
                              deadline_ms=PRIORITY_DEADLINE_MS, max_connections=1024),
            ))  # fmt: skip

        high, low = asyncio.run(both())
        out["high"], out["low"] = high.as_dict(), low.as_dict()
    return out


def render_priority(p: dict[str, Any]) -> str:
    h, lo = p["high"], p["low"]
    cap = p["capacity"]["capacity_rps"]
    return "\n".join([
        "| level | offered | in time of sent | in time of admitted | p99 in time | refused | "
        "refusal p99 |",
        "|---|---|---|---|---|---|---|",
        *(f"| {name} | {r['rate']:.0f}/s ({r['rate'] / cap:.1f}x) | {r['in_time_share']:.3f} | "
          f"{r['admitted_in_time_share']:.3f} | {r['p99_ms']:.1f} ms | {r['refused']} | "
          f"{r['refusal_p99_ms']:.1f} ms |" for name, r in (("1 (high)", h), ("2 (low)", lo))),
        "",
        f"Capacity {cap:.0f} req/s (low priority alone, the best goodput of "
        f"{', '.join(str(k) for k in sorted(int(k) for k in p['capacity']['sweep']))} req/s "
        f"offered); deadline {p['deadline_ms']:.0f} ms; the model (width {p.get('width')}) "
        f"runs a batch of 8 in {p.get('batch_8_ms')} ms in-process.",
    ])  # fmt: skip


def render(r: dict[str, Any]) -> str:
    lines = [
        "| mode | load | goodput req/s | 50 ms: in time of admitted | 50 ms p99 | "
        "500 ms: in time of admitted | 500 ms p99 | refused (50/500) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for factor in (0.8, 1.2):
        for mode in ("independent", "shared"):
            row = r[f"{mode}@{factor}"]
            a, b = row["50ms"], row["500ms"]

            def share(c: dict[str, Any]) -> str:
                v = c["admitted_in_time"]
                return "-" if v is None else f"{v:.3f}"

            def p99(c: dict[str, Any]) -> str:
                return "-" if c["p99_ms"] is None else f"{c['p99_ms']:.1f} ms"

            lines.append(
                f"| {mode} | {factor}x | {row['goodput_rps']:.0f} | {share(a)} | {p99(a)} | "
                f"{share(b)} | {p99(b)} | {a['refused']}/{b['refused']} |"
            )
    g = {f: r[f"shared@{f}"]["goodput_rps"] / r[f"independent@{f}"]["goodput_rps"]
         for f in (0.8, 1.2)}  # fmt: skip
    lines += [
        "",
        f"Capacity {r['capacity']['capacity_rps']:.0f} req/s (the shared server's best goodput "
        f"over {', '.join(str(k) for k in sorted(int(k) for k in r['capacity']['sweep']))} req/s "
        f"offered); shared / independent goodput: "
        f"{g[0.8]:.2f} at 0.8x, {g[1.2]:.2f} at 1.2x.",
        "",
        "In-process batch times (ms, one thread; batch 1 / 8): "
        # (Keys are ints in a run, strings once read back from the JSON.)
        + ", ".join(
            f"{m} {t.get(1, t.get('1'))}/{t.get(8, t.get('8'))}" for m, t in r["batch_ms"].items()
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results-shared-device.json")
    p.add_argument("--only-priority", action="store_true", help="the priority run alone")
    p.add_argument("--device", default="cpu", help="where the models run: cpu, cuda:0, ...")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="aserve-shared-"))
    try:
        results = run(args.duration, folder, args.only_priority, args.device)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.only_priority and args.json.exists():  # keep the other runs' results
        results = {**json.loads(args.json.read_text()), **results}
    args.json.write_text(json.dumps(results, indent=2))
    if "shared@0.8" in results:
        print(render(results))
        print()
    print(render_priority(results["priority"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
