"""The soak run: aserve under a long mixed load, its memory sampled from start to end.

    python -m bench.soak [--requests 200000] [--concurrency 64] [--segment 10] [--max-seconds 240]

One aserve process serves the tiny model (``bench.models`` "tiny": y = x + 1 on
16 floats; one instance, ``cpu_threads`` 1, max batch 32, max delay 2 ms,
preferred 8/16/32). ``bench.loadgen`` drives it closed-loop at
``--concurrency`` connections split over four request bodies: V2 JSON, the
binary tensor extension, gzip-compressed JSON, and a malformed body that must
be refused with 400 (the error path). Alongside, clients that go away: one
connection every ``--disconnect-every`` seconds sends a whole request, or half
of one, and closes without reading. The load runs in segments of
``--segment`` seconds until ``--requests`` responses have been counted (or
``--max-seconds`` have passed), after a ``--warmup`` that is not counted.

The server's RSS (its process tree, psutil) is sampled every
``--sample-interval`` seconds from the end of the warm-up to the end of the
load; growth is end over start. One answer is checked against the model
before and after. Writes ``RESULTS-soak.md`` and ``results-soak.json`` into
``--out-dir`` (default: bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from bench import loadgen
from bench.models import MODELS, default_cache_dir, expected_output, model_file, sample_input
from bench.proctree import tree_cpu_seconds
from bench.report import machine_facts
from bench.servers import MODEL_ENV, aserve_config, start_aserve

REPO = Path(__file__).resolve().parent.parent
TARGET_GROWTH = 0.05  # RSS end over start
IHCL = "Inference-Header-Content-Length"


def bodies(values: list[float]) -> dict[str, tuple[bytes, dict[str, str], int]]:
    """Each request kind: its body, its extra headers, the status it must get."""
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                       "data": values}]}  # fmt: skip
    plain = json.dumps(doc, separators=(",", ":")).encode()
    header = json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                    "parameters": {"binary_data_size": 4 * len(values)}}],
    }, separators=(",", ":")).encode()  # fmt: skip
    # Binary in, JSON out: bench.loadgen reads the first "Content-Length:" of a
    # response head, which in a binary answer is Inference-Header-Content-Length's.
    binary = header + np.asarray(values, "<f4").tobytes()
    bad = b'{"inputs":[{"name":"INPUT0","shape":[1,3],"datatype":"FP32","data":[1,2]}]}'
    return {
        "json": (plain, {}, 200),
        "binary": (binary, {IHCL: str(len(header))}, 200),
        "gzip": (gzip.compress(plain), {"Content-Encoding": "gzip"}, 200),
        "bad": (bad, {}, 400),
    }


def split(concurrency: int) -> dict[str, int]:
    """Connections per request kind: mostly JSON, a few malformed."""
    binary, zipped, bad = concurrency * 7 // 32, concurrency * 3 // 32, max(1, concurrency // 64)
    return {
        "json": concurrency - binary - zipped - bad,
        "binary": binary,
        "gzip": zipped,
        "bad": bad,
    }


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its live descendants."""
    root = psutil.Process(pid)
    total = 0
    for proc in (root, *root.children(recursive=True)):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


class Sampler:
    """RSS every ``interval_s`` seconds on the loop (psutil reads take microseconds)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int:
        rss = rss_bytes(self.pid)
        self.samples.append((round(time.monotonic() - self._t0, 2), rss))
        return rss

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rss-sampler")

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.sample()


async def disconnects(url: str, body: bytes, every_s: float, stop: asyncio.Event) -> int:
    """Clients that go away: a whole request or half of one, then close unread."""
    target = loadgen.Target.parse(url)
    request = loadgen.build_request(target, body)
    half = request[: len(request) - len(body) // 2]
    sent = 0
    while not stop.is_set():
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(target.host, target.port), 5)
        except (OSError, asyncio.TimeoutError):
            pass
        else:
            writer.write(request if sent % 2 == 0 else half)
            await asyncio.sleep(0.002 if sent % 2 == 0 else 0)  # let the whole one reach a queue
            writer.close()
            sent += 1
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    return sent


async def _segment(
    url: str, kinds: dict[str, tuple[bytes, dict[str, str], int]], conns: dict[str, int],
    seconds: float,
) -> dict[str, loadgen.LoadResult]:  # fmt: skip
    runs = [
        loadgen.run_load(url, kinds[k][0], n, seconds, warmup_s=0.0, headers=kinds[k][1])
        for k, n in conns.items()
    ]
    return dict(zip(conns, await asyncio.gather(*runs), strict=True))


def _check(status: int, body: bytes, expected: list[float]) -> None:
    if status != 200:
        raise RuntimeError(f"aserve answered {status}: {body[:300]!r}")
    loadgen.check_outputs(body, expected)


async def soak(url: str, pid: int, values: list[float], expected: list[float], args: Any) -> dict:
    kinds = bodies(values)
    conns = split(args.concurrency)
    _check(*await loadgen.fetch_once(url, kinds["json"][0]), expected)
    print(f"soak: warm-up {args.warmup} s", file=sys.stderr, flush=True)
    await _segment(url, kinds, conns, args.warmup)
    sampler = Sampler(pid, args.sample_interval)
    sampler.start()
    stop = asyncio.Event()
    churn = asyncio.get_running_loop().create_task(
        disconnects(url, kinds["json"][0], args.disconnect_every, stop)
    )
    totals = {k: {"requests": 0, "errors": 0, "statuses": {}, "lost": 0} for k in conns}
    segments: list[dict[str, Any]] = []
    cpu0, t0 = tree_cpu_seconds(pid), time.monotonic()
    while True:
        runs = await _segment(url, kinds, conns, args.segment)
        seg = {"t_s": round(time.monotonic() - t0, 1), "rss_mib": sampler.samples[-1][1] / 2**20}
        for k, r in runs.items():
            tot = totals[k]
            tot["requests"] += r.requests
            tot["errors"] += r.errors
            tot["lost"] += r.connections_lost
            for code, n in r.error_statuses.items():
                tot["statuses"][code] = tot["statuses"].get(code, 0) + n
            seg[k] = {
                "requests": r.requests,  # 400s included: "bad" has no other answers
                "per_s": round(r.requests / r.duration_s, 1),
                "p99_ms": round(r.p99_ms, 2),
            }
        segments.append(seg)
        done = sum(t["requests"] for t in totals.values())
        print(f"soak: {done} requests, {seg['t_s']} s, RSS {seg['rss_mib']:.1f} MiB",
              file=sys.stderr, flush=True)  # fmt: skip
        if done >= args.requests or time.monotonic() - t0 + args.segment > args.max_seconds:
            break
    elapsed = time.monotonic() - t0
    cpu = tree_cpu_seconds(pid) - cpu0
    stop.set()
    disconnected = await churn
    await sampler.stop()
    _check(*await loadgen.fetch_once(url, kinds["json"][0]), expected)
    for k, tot in totals.items():
        # A refusal is the right answer for "bad"; anything else unexpected counts.
        want = kinds[k][2]
        tot["unexpected"] = tot["errors"] - (tot["statuses"].get(want, 0) if want != 200 else 0)
        if want != 200:
            tot["answered_as_expected"] = tot["statuses"].get(want, 0)
    return {
        "connections": conns,
        "elapsed_s": round(elapsed, 1),
        "server_cpu_s": round(cpu, 1),
        "totals": totals,
        "disconnects": disconnected,
        "segments": segments,
        "rss_samples": sampler.samples,
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    rss = [r for _, r in run["rss_samples"]]
    start, end, peak = rss[0], rss[-1], max(rss)
    requests = sum(t["requests"] for t in run["totals"].values())
    return {
        "requests": requests,
        "unexpected_errors": sum(t["unexpected"] for t in run["totals"].values()),
        "refused_as_expected": sum(
            t.get("answered_as_expected", 0) for t in run["totals"].values()
        ),
        "rps": round(requests / run["elapsed_s"], 1),
        "server_cpu_ms_per_request": round(1e3 * run["server_cpu_s"] / requests, 3),
        "rss_start_mib": round(start / 2**20, 1),
        "rss_end_mib": round(end / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_growth": round((end - start) / start, 4),
        "rss_growth_met": (end - start) / start < TARGET_GROWTH,
    }


def render(results: dict[str, Any]) -> str:
    f, s, run = results["facts"], results["summary"], results["run"]
    verdict = "**met**" if s["rss_growth_met"] else "**missed**"
    lines = [
        "# Soak run: aserve under a long mixed load, RSS from start to end",
        "",
        f"Generated by `{f['command']}` on {f['date_utc']} ({f['cpu_model']}, "
        f"{f['usable_cores']} cores; Python {f['python']}, torch {f['versions']['torch']}). "
        f"Load average before {f['loadavg_before']}, after {f['loadavg_after']}.",
        "",
        f"Model: {results['model']}. aserve: one process, one instance, cpu_threads 1, "
        "max_batch_size 32, max_delay_ms 2, preferred 8/16/32. Load: `bench.loadgen` closed "
        f"loop, {sum(run['connections'].values())} keep-alive connections "
        f"({', '.join(f'{n} {k}' for k, n in run['connections'].items())}), in "
        f"{results['segment_s']} s segments after a {results['warmup_s']} s warm-up, in the "
        "bench process on the same cores as the server; one connection every "
        f"{results['disconnect_every_s']} s sent a request (or half of one) and closed unread.",
        "",
        "| requests | unexpected errors | refused (400) as expected | disconnects | seconds "
        "| req/s | server CPU ms/req | RSS start MiB | RSS end MiB | RSS peak MiB | growth |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['requests']:,} | {s['unexpected_errors']} | {s['refused_as_expected']:,} "
        f"| {run['disconnects']:,} | {run['elapsed_s']} | {s['rps']:,.0f} "
        f"| {s['server_cpu_ms_per_request']:.3f} | {s['rss_start_mib']} | {s['rss_end_mib']} "
        f"| {s['rss_peak_mib']} | {s['rss_growth']:+.2%} |",
        "",
        f"RSS growth target: under {TARGET_GROWTH:.0%} from the end of the warm-up to the end "
        f"of the load: {verdict}. RSS is the server's process tree, sampled every "
        f"{results['sample_interval_s']} s ({len(run['rss_samples'])} samples in "
        "`results-soak.json`). One answer was checked against the model before and after.",
        "",
        "| segment end, s | RSS MiB | "
        + " | ".join(f"{k} answers/s" for k in run["connections"])
        + " |",
        "|---:|---:|" + "---:|" * len(run["connections"]),
    ]
    for seg in run["segments"]:
        cells = " | ".join(f"{seg[k]['per_s']:,.0f}" for k in run["connections"])
        lines.append(f"| {seg['t_s']} | {seg['rss_mib']:.1f} | {cells} |")
    lines += ["", "Per kind: " + "; ".join(
        f"{k} {t['requests']:,} requests, statuses other than 200: {t['statuses'] or 'none'}"
        f", connections lost {t['lost']}" for k, t in run["totals"].items()
    ) + ".", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200_000, help="responses to count")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--segment", type=float, default=10.0, help="seconds per load segment")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--max-seconds", type=float, default=240.0, help="stop by then regardless")
    p.add_argument("--sample-interval", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--disconnect-every", type=float, default=0.05)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    torch.set_num_threads(1)
    facts = machine_facts(" ".join(["python -m bench.soak", *(argv or sys.argv[1:])]))
    model = MODELS["tiny"]
    path = model_file(model, args.cache_dir or default_cache_dir())
    values = sample_input(model)
    expected = expected_output(path, values)
    config = aserve_config("tiny", path.name, model.features)
    cfg_path = path.parent / "tiny-soak.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    runner: Callable[..., Any]
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    print("soak: starting aserve", file=sys.stderr, flush=True)
    with start_aserve(cfg_path, REPO) as server:
        url = f"{server.base_url}/v2/models/tiny/infer"
        run = runner(soak(url, server.pid, values, expected, args))
        with urllib.request.urlopen(f"{server.base_url}/v2/models/tiny/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]
    facts["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results = {
        "facts": facts,
        "model": model.description,
        "segment_s": args.segment,
        "warmup_s": args.warmup,
        "sample_interval_s": args.sample_interval,
        "disconnect_every_s": args.disconnect_every,
        "aserve_config": config,
        "summary": summarize(run),
        "server_inference_count": stats["inference_count"],
        "run": run,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results-soak.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out_dir / "RESULTS-soak.md").write_text(render(results))
    s = results["summary"]
    print(f"soak: {s['requests']} requests, RSS {s['rss_start_mib']} -> {s['rss_end_mib']} MiB "
          f"({s['rss_growth']:+.2%}); wrote {args.out_dir / 'RESULTS-soak.md'}", file=sys.stderr)  # fmt: skip
    ok = s["requests"] >= args.requests and s["unexpected_errors"] == 0 and s["rss_growth_met"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
