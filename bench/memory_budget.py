"""Many models in a memory budget: loads on demand and LRU eviction under Zipf traffic.

24 TorchScript MLPs (64 -> w -> w -> 64, w from 640 to 2880: about 1.6 to 32
MiB of weights each, the sizes shuffled over the ranks with a fixed seed)
are served by one aserve whose CPU has a ``memory_budget_mib`` that holds
about six of them (six times their mean size, and 16 MiB), every model
``"load": "on_demand"``. Traffic is open loop, Zipf(1.0) over the models
(the model of rank k gets 1/k of it), each request with a deadline (the
``aserve-timeout-ms`` header) and given up by the client at it.

Measured:

- memory: the server's process tree's RSS sampled every 50 ms, its peak
  less the baseline (the RSS once ready, before any model loaded: the
  interpreter, torch, the frontends), against the budget; the budget
  counts models' footprints only, so this is an upper view (it also holds
  request buffers, torch's one-time setup at the first load, allocator
  slack); and the server's own account (``aserve_device_memory_used_bytes``,
  scraped every 0.5 s), whose peak the budget bounds by construction;
- every answer that is not a 200, by status and reason (a 503 that says the
  model is loading and by when is a load-deadline refusal);
- the three hottest models' p99 against a second server that serves only
  those three, loaded at startup, with the same traffic to them (run after
  the first, in the same invocation); on the first server they are loaded
  by one request each before the window, after the baseline is read;
- loads and evictions per minute (from the server's log lines);
- each model's cold loads (their times in the log) against the same model's
  load in this process (``torch.jit.load`` and the warm-up batches the server
  runs: 1 and 8, twice), one thread.

    python -m bench.memory_budget [--duration 300] [--rate 20] [--deadline-ms 2000]

writes ``bench/results-memory-budget.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import torch

from bench.peers.launch import Plan, Running, free_port

REPO = Path(__file__).resolve().parent.parent
MODELS = 24
HOT = 3
FEATURES = 64
MIN_WIDTH, MAX_WIDTH = 640, 2880
FIT = 6  # models the budget holds, of the mean size
SEED = 20240
MIB = 1 << 20
RSS_EVERY_S = 0.05
METRICS_EVERY_S = 0.5


# --- the models -------------------------------------------------------------------


def widths() -> list[int]:
    """Each rank's width (rank 1 first): a geometric spread, shuffled with SEED."""
    ws = [round(MIN_WIDTH * (MAX_WIDTH / MIN_WIDTH) ** (i / (MODELS - 1)) / 32) * 32
          for i in range(MODELS)]  # fmt: skip
    random.Random(SEED).shuffle(ws)
    return ws


def build(rank: int, width: int, folder: Path) -> Path:
    torch.manual_seed(rank)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, FEATURES),
    ).eval()  # fmt: skip
    path = folder / f"m{rank}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(net).save(str(path))
    return path


def in_process_load_s(path: Path) -> float:
    """The model's load as the server does it, in this process: read, then the
    warm-up batches (1 and 8, twice), one thread."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.jit.load(str(path), map_location="cpu").eval()
    with torch.inference_mode():
        for _ in range(2):
            for b in (1, 8):
                m(torch.zeros(b, FEATURES))
    return time.perf_counter() - t0


def model_entry(
    rank: int, on_demand: bool, deadline_ms: float, resident: bool = False
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": f"m{rank}", "engine": "torch", "path": f"m{rank}.pt", "cpu_threads": 1,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [FEATURES]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [FEATURES]}],
        "batching": {"max_batch_size": 8, "max_delay_ms": 1.0, "timeout_ms": deadline_ms},
    }  # fmt: skip
    if on_demand:
        entry["load"] = "on_demand"
    if resident:
        entry["resident"] = True
    return entry


def write_config(
    folder: Path, port: int, ranks: list[int], budget_mib: int | None, deadline_ms: float,
    resident: tuple[int, ...] = (),
) -> Path:  # fmt: skip
    config: dict[str, Any] = {
        "http": {"host": "127.0.0.1", "port": port},
        "models": [model_entry(k, budget_mib is not None, deadline_ms, k in resident)
                   for k in ranks],
    }  # fmt: skip
    if budget_mib is not None:
        config["devices"] = {"cpu": {"memory_budget_mib": budget_mib}}
    path = folder / ("budget.json" if budget_mib is not None else "hot-only.json")
    path.write_text(json.dumps(config, indent=2))
    return path


BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, FEATURES],
                    "data": [0.5] * FEATURES}]}  # fmt: skip


# --- the server and what is sampled of it -----------------------------------------


def serve(label: str, config: Path, folder: Path) -> Running:
    port = json.loads(config.read_text())["http"]["port"]
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "aserve", "--config", str(config), "--log-level", "INFO"]
    plan = Plan(label, argv, f"{base}/v2/health/ready", cwd=REPO, start_timeout_s=300)

    async def ready() -> tuple[int, bytes]:
        # Ready, not a request: the first inference would load a model.
        async with aiohttp.ClientSession() as s, s.get(plan.url) as r:
            return r.status, await r.read()

    return Running(plan, b"", folder / f"{label}.log", first=ready)


class Sampler(threading.Thread):
    """The server tree's RSS every RSS_EVERY_S, and its device account every
    METRICS_EVERY_S, until stopped."""

    def __init__(self, pid: int, base: str) -> None:
        super().__init__(daemon=True)
        self._pid = pid
        self._base = base
        self._stop_event = threading.Event()
        self.rss: list[tuple[float, int]] = []
        self.used: list[tuple[float, float]] = []

    def tree_rss(self) -> int:
        try:
            root = psutil.Process(self._pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    def run(self) -> None:
        next_scrape = 0.0
        while not self._stop_event.wait(RSS_EVERY_S):
            now = time.time()
            self.rss.append((now, self.tree_rss()))
            if now >= next_scrape:
                next_scrape = now + METRICS_EVERY_S
                used = scrape_used(self._base)
                if used is not None:
                    self.used.append((now, used))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def scrape_used(base: str) -> float | None:
    """aserve_device_memory_used_bytes of the cpu, from /metrics (blocking)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(r'^aserve_device_memory_used_bytes\{device="cpu"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def baseline_rss(sampler: Sampler, seconds: float = 1.0) -> int:
    """The tree's RSS before any load: the median of a second's samples."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(sampler.tree_rss())
        time.sleep(RSS_EVERY_S)
    return int(statistics.median(samples))


# --- the traffic --------------------------------------------------------------------


def zipf_weights(n: int) -> list[float]:
    raw = [1.0 / (k + 1) for k in range(n)]
    return [w / sum(raw) for w in raw]


def reason_of(status: int, error: str) -> str:
    """A short name for why a request was not answered 200."""
    if " is loading: ready in about " in error:
        return "load deadline (refused at once: loading, and by when)"
    if "still loading at the request's deadline" in error:
        return "still loading at its deadline"
    if "does not fit in its memory_budget_mib" in error:
        return "no room (what holds the budget is resident or busy)"
    if "more than its memory_budget_mib" in error:
        return "no room once measured (loaded, then unloaded)"
    if "failed to load" in error or "(failed: " in error:
        return "load failed"
    if status == 0:
        return error or "no answer"
    return re.sub(r"'[^']*'", "'…'", error)[:90]


async def traffic(
    base: str, ranks: list[int], weights: list[float], rate: float, duration_s: float,
    deadline_ms: float, seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Open loop: ``rate`` requests a second for ``duration_s``, each to a model of
    ``ranks`` drawn with ``weights``; every request's outcome."""
    rng = random.Random(seed)
    cumulative = []
    acc = 0.0
    for w in weights:
        acc += w
        cumulative.append(acc)
    records: list[dict[str, Any]] = []
    headers = {"aserve-timeout-ms": str(int(deadline_ms))}
    timeout = aiohttp.ClientTimeout(total=deadline_ms / 1e3 + 0.5)
    body = json.dumps(BODY).encode()

    async def one(session: aiohttp.ClientSession, rank: int, sent_at: float) -> None:
        t0 = time.perf_counter()
        status, error = 0, ""
        try:
            async with session.post(
                f"{base}/v2/models/m{rank}/infer", data=body, headers=headers, timeout=timeout
            ) as r:
                status = r.status
                payload = await r.read()
            if status != 200:
                try:
                    error = json.loads(payload).get("error", "")
                except ValueError:
                    error = payload[:200].decode(errors="replace")
        except asyncio.TimeoutError:
            error = "given up by the client at its deadline"
        except aiohttp.ClientError as exc:
            error = f"connection: {type(exc).__name__}"
        ms = (time.perf_counter() - t0) * 1e3
        records.append({"t": sent_at, "model": f"m{rank}", "status": status, "ms": ms,
                        "in_time": status == 200 and ms <= deadline_ms,
                        "reason": "" if status == 200 else reason_of(status, error)})  # fmt: skip

    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        period = 1.0 / rate
        t0 = time.perf_counter()
        i = 0
        while True:
            due = t0 + i * period
            now = time.perf_counter()
            if due - t0 >= duration_s:
                break
            if due > now:
                await asyncio.sleep(due - now)
            rank = ranks[bisect.bisect_left(cumulative, rng.random() * acc)]
            tasks.append(asyncio.ensure_future(one(session, rank, time.time())))
            i += 1
        await asyncio.gather(*tasks)
    return records


async def warm(base: str, ranks: list[int]) -> None:
    async with aiohttp.ClientSession() as session:
        for k in ranks:
            async with session.post(f"{base}/v2/models/m{k}/infer", json=BODY) as r:
                assert r.status == 200, await r.text()


# --- what the server's log says -----------------------------------------------------

LOADED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: model (m\d+)/1 loaded on cpu in ([\d.]+) s")
EVICTED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: evicting model (m\d+)/1 ")


def _log_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(path: Path, start: float, end: float) -> dict[str, Any]:
    loads: list[tuple[float, str, float]] = []
    evictions: list[tuple[float, str]] = []
    for line in path.read_text(errors="replace").splitlines():
        if m := LOADED.match(line):
            loads.append((_log_time(m.group(1)), m.group(2), float(m.group(3))))
        elif m := EVICTED.match(line):
            evictions.append((_log_time(m.group(1)), m.group(2)))
    # The log's clock has millisecond stamps; the window is the traffic's.
    loads = [x for x in loads if start - 1 <= x[0] <= end + 1]
    evictions = [x for x in evictions if start - 1 <= x[0] <= end + 1]
    return {"loads": loads, "evictions": evictions}


# --- the run ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(records: list[dict[str, Any]], models: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in models:
        mine = [r for r in records if r["model"] == name]
        ok = [r["ms"] for r in mine if r["in_time"]]
        out[name] = {"sent": len(mine), "ok_in_time": len(ok), "p50_ms": pct(ok, 0.5),
                     "p99_ms": pct(ok, 0.99)}  # fmt: skip
    return out


def not_ok(records: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r["status"] != 200:
            key = f"{r['status'] or 'none'}: {r['reason']}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def run(
    duration_s: float, rate: float, deadline_ms: float, folder: Path, resident_hot: bool = False
) -> dict[str, Any]:
    ws = widths()
    ranks = list(range(1, MODELS + 1))
    paths = {k: build(k, ws[k - 1], folder) for k in ranks}
    file_mib = {f"m{k}": paths[k].stat().st_size / MIB for k in ranks}
    in_process = {f"m{k}": round(in_process_load_s(paths[k]), 4) for k in ranks}
    budget_mib = round(FIT * statistics.mean(file_mib.values()) + 16)
    weights = zipf_weights(MODELS)
    resident = tuple(ranks[:HOT]) if resident_hot else ()
    results: dict[str, Any] = {
        "duration_s": duration_s, "rate": rate, "deadline_ms": deadline_ms,
        "budget_mib": budget_mib, "resident": [f"m{k}" for k in resident], "models": {
            f"m{k}": {"width": ws[k - 1], "file_mib": round(file_mib[f"m{k}"], 2),
                      "share": round(weights[k - 1], 4), "in_process_load_s": in_process[f"m{k}"]}
            for k in ranks
        },
    }  # fmt: skip

    port = free_port()
    cfg = write_config(folder, port, ranks, budget_mib, deadline_ms, resident)
    with serve("budget", cfg, folder) as srv:
        base = f"http://127.0.0.1:{port}"
        sampler = Sampler(srv.pid, base)
        baseline = baseline_rss(sampler)
        sampler.start()
        # The hottest models loaded before the window, as the other server's are at
        # its start: their p99 is then the steady state's, not their first load's.
        asyncio.run(warm(base, ranks[:HOT]))
        start = time.time()
        records = asyncio.run(traffic(base, ranks, weights, rate, duration_s, deadline_ms, SEED))
        end = time.time()
        sampler.stop()
        events = log_events(srv.log_path, start, end)
    rss_over = [(t, rss - baseline) for t, rss in sampler.rss if start <= t <= end + 1]
    peak_t, peak = max(rss_over, key=lambda x: x[1]) if rss_over else (start, 0)
    used_peak = max((u for _, u in sampler.used), default=0.0)
    # What the RSS holds beyond the account, at each scrape (the RSS sample nearest it).
    times = [t for t, _ in sampler.rss]
    gaps = []
    for t, u in sampler.used:
        if start <= t <= end and times:
            i = min(bisect.bisect_left(times, t), len(times) - 1)
            gaps.append((sampler.rss[i][1] - baseline - u) / MIB)
    minutes = (end - start) / 60
    loads_by_model: dict[str, list[float]] = {}
    for _, name, s in events["loads"]:
        loads_by_model.setdefault(name, []).append(s)
    results["budget_server"] = {
        "baseline_rss_mib": round(baseline / MIB, 1),
        "peak_rss_over_baseline_mib": round(peak / MIB, 1),
        "peak_at_s": round(peak_t - start, 1),
        "rss_samples": len(rss_over),
        "peak_accounted_mib": round(used_peak / MIB, 1),
        "accounted_samples": len(sampler.used),
        "rss_beyond_account_mib": {"median": round(statistics.median(gaps), 1) if gaps else None,
                                   "max": round(max(gaps), 1) if gaps else None},
        "sent": len(records),
        "ok_in_time": sum(r["in_time"] for r in records),
        "not_ok": not_ok(records),
        "loads": len(events["loads"]),
        "evictions": len(events["evictions"]),
        "loads_per_min": round(len(events["loads"]) / minutes, 1),
        "evictions_per_min": round(len(events["evictions"]) / minutes, 1),
        "cold_loads_s": {k: [round(x, 3) for x in v] for k, v in sorted(loads_by_model.items(),
                                                                      key=lambda kv: int(kv[0][1:]))},
        "per_model": summarize(records, [f"m{k}" for k in ranks]),
    }  # fmt: skip

    hot = ranks[:HOT]
    hot_weights = [weights[k - 1] for k in hot]
    hot_rate = rate * sum(hot_weights)
    port = free_port()
    cfg = write_config(folder, port, hot, None, deadline_ms)
    with serve("hot-only", cfg, folder):
        base = f"http://127.0.0.1:{port}"
        ref = asyncio.run(traffic(base, hot, hot_weights, hot_rate, duration_s, deadline_ms,
                                  SEED + 1))  # fmt: skip
    results["hot_only_server"] = {
        "rate": round(hot_rate, 2), "sent": len(ref), "not_ok": not_ok(ref),
        "per_model": summarize(ref, [f"m{k}" for k in hot]),
    }  # fmt: skip
    return results


# --- the report --------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render(r: dict[str, Any]) -> str:
    b, h = r["budget_server"], r["hot_only_server"]
    lines = [
        f"{len(r['models'])} models, budget {r['budget_mib']} MiB on the cpu (about {FIT} of "
        f"their mean size), Zipf(1.0) open loop at {r['rate']:g} req/s for "
        f"{r['duration_s']:g} s, deadline {r['deadline_ms']:g} ms"
        + (f"; {', '.join(r['resident'])} marked resident." if r.get("resident") else "."),
        "",
        "| memory | MiB |",
        "|---|---|",
        f"| budget | {r['budget_mib']} |",
        f"| peak of the server's RSS less its baseline ({b['baseline_rss_mib']} MiB before any "
        f"load), {b['rss_samples']} samples every {RSS_EVERY_S * 1e3:.0f} ms | "
        f"{b['peak_rss_over_baseline_mib']} |",
        f"| peak of what the server accounts to its models (/metrics, {b['accounted_samples']} "
        f"samples) | {b['peak_accounted_mib']} |",
        f"| RSS less baseline, beyond the account at each scrape: median / max | "
        f"{b['rss_beyond_account_mib']['median']} / {b['rss_beyond_account_mib']['max']} |",
        "",
        "| answers | count |",
        "|---|---|",
        f"| sent | {b['sent']} |",
        f"| 200 in time | {b['ok_in_time']} |",
        *(f"| {k} | {v} |" for k, v in b["not_ok"].items()),
        "",
        f"Loads {b['loads']} ({b['loads_per_min']}/min), evictions {b['evictions']} "
        f"({b['evictions_per_min']}/min).",
        "",
        "| hot model | share | p99 with the budget (ms) | p99 serving only the 3 (ms) | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, ref in h["per_model"].items():
        mine = b["per_model"][name]
        ratio = (mine["p99_ms"] / ref["p99_ms"]) if mine["p99_ms"] and ref["p99_ms"] else None
        lines.append(
            f"| {name} | {r['models'][name]['share']:.3f} | {_ms(mine['p99_ms'])} | "
            f"{_ms(ref['p99_ms'])} | {'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    lines += [
        "",
        "| model | MiB | share | cold loads | median load (s) | max load (s) | in-process (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in r["models"].items():
        loads = b["cold_loads_s"].get(name, [])
        med = f"{statistics.median(loads):.3f}" if loads else "-"
        top = f"{max(loads):.3f}" if loads else "-"
        lines.append(
            f"| {name} | {m['file_mib']:.1f} | {m['share']:.3f} | {len(loads)} | {med} | {top} | "
            f"{m['in_process_load_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, all models")
    p.add_argument("--deadline-ms", type=float, default=2000.0)
    p.add_argument("--resident-hot", action="store_true",
                   help="mark the 3 hottest models resident (never evicted)")  # fmt: skip
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results-memory-budget.json")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="aserve-memory-"))
    try:
        results = run(args.duration, args.rate, args.deadline_ms, folder, args.resident_hot)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results["command"] = "python -m bench.memory_budget " + " ".join(argv or sys.argv[1:])
    args.json.write_text(json.dumps(results, indent=2))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
