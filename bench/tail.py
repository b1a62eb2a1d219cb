"""Where MiniLM's tail at c=64 comes from: each request's time against the model's own batch times.

    python -m bench.tail [--servers aserve,aserve-thread] [--concurrency 64]
                         [--duration 15] [--warmup 4] [--model-seconds 12]

A closed loop of ``--concurrency`` keep-alive clients (aiohttp), each
recording when it sent and when its answer came, against the MiniLM handler
of ``bench.peers`` (workload 2; ``aserve``: the model in a worker process,
``aserve-thread``: on an instance thread). With 64 clients and batches of
32, a request waits for the batch that is running and then runs in the
next: its time is two batch times, and the queueing floor is 64 ÷
throughput. What can widen the tail past it, measured here:

- **response writing / batch order**: the answers of one batch, grouped by
  the gaps between answers, and how long the group takes to leave (first to
  last answer), and each request's time by its place in its group;
- **the model's own batch time**: the intervals between groups (one batch
  each, with the model busy all the time), beside the same batch of 32 run
  in this process in a loop before and after the servers (no server
  running), and the p99 of two consecutive in-process batch times over their
  mean: the tail that batch times alone make.

Writes ``RESULTS-tail.md`` and ``results-tail.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import report as bench_report
from bench.models import MODELS, default_cache_dir, model_file
from bench.peers import launch, venvs
from bench.peers.launch import Context, Running
from bench.peers.run import log, source_state
from bench.servers import MODEL_ENV

GROUP_GAP_S = 0.015  # answers closer than this belong to one batch (batches take 100+ ms)


def _q(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def model_times(seconds: float, minilm_dir: Path) -> list[float]:
    """Seconds per batch of 32 of the model in this process, in a loop for ``seconds``."""
    import common  # bench/peers/apps/common.py, on sys.path
    import torch

    torch.set_num_threads(1)
    model = common.MiniLM(str(minilm_dir))
    batch = model.tokenize([common.SENTENCE] * 32)
    for _ in range(3):
        model.forward(batch["input_ids"], batch["attention_mask"])
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        model.forward(batch["input_ids"], batch["attention_mask"])
        times.append(time.perf_counter() - t0)
    return times


async def closed_loop(
    url: str, body: bytes, concurrency: int, warmup: float, duration: float
) -> list[tuple[float, float]]:
    """(sent, answered) monotonic times of every 200 sent inside the window."""
    records: list[tuple[float, float]] = []
    failures = 0
    end = time.monotonic() + warmup + duration
    start = end - duration

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        while (sent := time.monotonic()) < end:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                ok = r.status == 200
            if not ok:
                failures += 1
            elif sent >= start:
                records.append((sent, time.monotonic()))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    if failures:
        raise RuntimeError(f"{failures} requests were not answered 200")
    return records


def analyse(records: list[tuple[float, float]], concurrency: int) -> dict[str, Any]:
    records = sorted(records, key=lambda r: r[1])
    latency = [b - a for a, b in records]
    throughput = len(records) / (records[-1][1] - records[0][1])
    floor = concurrency / throughput
    groups: list[list[tuple[float, float]]] = [[records[0]]]
    for r in records[1:]:
        if r[1] - groups[-1][-1][1] < GROUP_GAP_S:
            groups[-1].append(r)
        else:
            groups.append([r])
    full = groups[1:-1]  # the window cuts the first and the last
    starts = [g[0][1] for g in full]
    intervals = [b - a for a, b in itertools.pairwise(starts)]
    by_place: dict[str, list[float]] = {}
    for g in full:
        for i, (a, b) in enumerate(g):
            by_place.setdefault(f"{8 * (i // 8) + 1}-{8 * (i // 8) + 8}", []).append(b - a)
    return {
        "requests": len(records),
        "throughput": round(throughput, 1),
        "mean_ms": round(statistics.mean(latency) * 1e3, 1),
        "p50_ms": round(_q(latency, 0.5) * 1e3, 1),
        "p99_ms": round(_q(latency, 0.99) * 1e3, 1),
        "floor_ms": round(floor * 1e3, 1),
        "p99_over_floor": round(_q(latency, 0.99) / floor, 3),
        "groups": len(full),
        "group_size_mean": round(statistics.mean(len(g) for g in full), 1),
        "group_leave_ms_mean": round(statistics.mean((g[-1][1] - g[0][1]) * 1e3 for g in full), 1),
        "group_leave_ms_max": round(max((g[-1][1] - g[0][1]) * 1e3 for g in full), 1),
        "interval_ms": _spread(intervals),
        "mean_ms_by_place": {k: round(statistics.mean(v) * 1e3, 1) for k, v in by_place.items()},
    }


def _spread(seconds: list[float]) -> dict[str, float]:
    return {
        k: round(v * 1e3, 1)
        for k, v in (
            ("p10", _q(seconds, 0.1)), ("p50", _q(seconds, 0.5)), ("p90", _q(seconds, 0.9)),
            ("max", max(seconds)), ("mean", statistics.mean(seconds)),
        )
    }  # fmt: skip


def model_alone(times: list[float]) -> dict[str, Any]:
    """The in-process batch times, and the tail two consecutive ones make by themselves."""
    pairs = [a + b for a, b in itertools.pairwise(times)]
    return {
        "batches": len(times),
        "batch_ms": _spread(times),
        "pair_p99_over_mean": round(_q(pairs, 0.99) / statistics.mean(pairs), 3),
    }


def render(results: dict[str, Any], notes: str) -> str:
    f = results["facts"]
    alone = results["model_alone"]
    lines = [
        "# Where MiniLM's tail at c=64 comes from",
        "",
        f"Generated by `{f['command']}` on {f['date_utc']}; aserve at {f['aserve_source']}.",
        f"{f['cpu_model']}, {f['usable_cores']} usable cores; load average before "
        f"{f['loadavg_before']}.",
        "",
        f"Closed loop, {results['concurrency']} keep-alive clients, one sentence per request, "
        "batches of up to 32 (max wait 5 ms), one torch thread. A request's time is two batch "
        "times (the running batch, then its own); the queueing floor is clients ÷ throughput.",
        "",
        "| server | req/s | mean ms | p50 ms | p99 ms | floor ms | p99 ÷ floor | answer groups "
        "(mean size) | a group leaves in (mean / max ms) | batch interval p10 / p50 / p90 / max ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["servers"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} |" + " |" * 9)
            continue
        iv = r["interval_ms"]
        lines.append(
            f"| {name} | {r['throughput']:.1f} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['floor_ms']:.1f} | **{r['p99_over_floor']:.3f}** | "
            f"{r['groups']} ({r['group_size_mean']:.1f}) | {r['group_leave_ms_mean']:.1f} / "
            f"{r['group_leave_ms_max']:.1f} | {iv['p10']:.0f} / {iv['p50']:.0f} / {iv['p90']:.0f} / "
            f"{iv['max']:.0f} |"
        )
    b = alone["batch_ms"]
    lines += [
        "",
        "Mean time by the place of a request's answer in its group (ms):",
        "",
    ]
    for name, r in results["servers"].items():
        if "error" not in r:
            places = ", ".join(f"{k}: {v:.1f}" for k, v in r["mean_ms_by_place"].items())
            lines.append(f"- {name}: {places}")
    lines += [
        "",
        f"The model alone, in this process with no server running ({alone['batches']} batches "
        f"of 32, before and after the servers): p10 {b['p10']:.0f}, p50 {b['p50']:.0f}, p90 "
        f"{b['p90']:.0f}, max {b['max']:.0f} ms; the p99 of two consecutive batch times over "
        f"their mean: **{alone['pair_p99_over_mean']:.3f}** (the tail that batch times alone "
        "make; the issue's target for aserve: p99 ÷ floor <= 1.07).",
        "",
        "## Notes",
        "",
        notes,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.tail", description=__doc__.split("\n")[0])
    p.add_argument("--servers", default="aserve,aserve-thread")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--model-seconds", type=float, default=12.0, help="in-process, before and after")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(raw)
    facts = bench_report.machine_facts(shlex.join(["python", "-m", "bench.tail", *raw]))
    facts["aserve_source"] = source_state()
    cache = args.cache_dir or default_cache_dir()
    os.environ.update(MODEL_ENV)
    os.environ["BENCH_TORCH_THREADS"] = "1"
    sys.path.insert(0, str(launch.APPS))
    import common

    minilm = venvs.ensure_minilm(cache)
    log("the model alone, before the servers")
    times = model_times(args.model_seconds / 2, minilm)
    servers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="aserve-tail-") as tmp:
        ctx = Context(
            cache=cache, scratch=Path(tmp), minilm_dir=minilm, venv_python={}, torch_threads=1,
            max_batch=32, max_wait_ms=5.0, tiny_model_file=model_file(MODELS["tiny"], cache),
        )  # fmt: skip
        body = common.request_body("minilm")
        for name in [s.strip() for s in args.servers.split(",")]:
            plan = launch.plan_for(name, ctx, "minilm")
            try:
                with Running(plan, body, Path(tmp) / f"{name}.log"):
                    records = asyncio.run(
                        closed_loop(plan.url, body, args.concurrency, args.warmup, args.duration)
                    )
                servers[name] = analyse(records, args.concurrency)
                r = servers[name]
                log(f"  {name}: {r['throughput']} req/s, p99 {r['p99_ms']} ms, "
                    f"p99/floor {r['p99_over_floor']}")  # fmt: skip
            except (launch.StartError, RuntimeError, OSError) as exc:
                servers[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
                log(f"  {name}: FAILED: {str(exc)[-300:]}")
    log("the model alone, after the servers")
    times += model_times(args.model_seconds / 2, minilm)
    results = {
        "facts": facts, "concurrency": args.concurrency, "servers": servers,
        "model_alone": model_alone(times),
    }  # fmt: skip
    log(f"wrote {bench_report.write_results(args.out_dir, 'tail', results, render)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
