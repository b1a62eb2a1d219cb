"""Many models in a memory budget: loads on demand and eviction under Zipf traffic.

24 TorchScript MLPs (64 -> w -> w -> 64, w from 640 to 2880: about 1.6 to 32
MiB of weights each, the sizes shuffled over the ranks with a fixed seed)
are served by one aserve whose CPU has a ``memory_budget_mib`` that holds
about six of them (six times their mean size, and 16 MiB), every model
``"load": "on_demand"``. Traffic is open loop, Zipf(1.0) over the models
(the model of rank k gets 1/k of it), each request with a deadline (the
``aserve-timeout-ms`` header) and given up by the client at it.

The same traffic (the same seed) runs against one such server per eviction
rule asked for (``--policy``: the device's ``"eviction"``, ``cost`` and
``lru``, one after the other; both by default), then against a reference
server that serves only the three hottest.

Measured, for each rule:

- memory: the server's process tree's RSS sampled every 50 ms, its peak
  less the baseline (the RSS once ready, before any model loaded: the
  interpreter, torch, the frontends), against the budget; the budget
  counts models' footprints only, so this is an upper view (it also holds
  request buffers, torch's one-time setup at the first load, allocator
  slack); and the server's own account (``aserve_device_memory_used_bytes``,
  scraped every 0.5 s), whose peak the budget bounds by construction;
- every answer that is not a 200, by status and reason (a 503 that says the
  model is loading and by when is a load-deadline refusal);
- the three hottest models' p99 against the reference server, which has
  them loaded at startup and gets the same traffic to them; on the budgeted
  servers they are loaded by one request each before the window, after the
  baseline is read and after the coldest model (which takes the first load's
  share of torch's one-time setup, see ``budget_run``). Their requests are also split by whether a load (of any
  model) ran while they did, from the log's load times, and their own loads
  in the window are counted: what keeps their p99 from the reference's;
- loads and evictions per minute, of the evictions those that parked the
  model (its weights released, its module kept) and of the loads those that
  read a parked model's weights back, and the loads that waited for a busy
  model cheaper to evict (from the server's log lines);
- each model's cold loads (their times in the log) against the same model's
  load in this process (``torch.jit.load`` and the warm-up batches the server
  runs: 1 and 8, twice), one thread.

    python -m bench.memory_budget [--duration 300] [--rate 20] [--deadline-ms 2000]
        [--policy both|cost|lru] [--resident-hot] [--device cpu|cuda:N]
        [--park default|on|off]

With ``--device cuda:N`` the models and the budget are on that GPU, and the
memory sampled is the device's own (``torch.cuda.mem_get_info``: what every
process holds on it, less what it held once the server was ready), in place
of the RSS.

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
POLICIES = ("cost", "lru")
# Where the models run (--device): cpu, or a GPU whose memory is then what is sampled.
DEVICE = "cpu"
PARK: bool | None = None  # the device's park_evicted (None: its default)


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
        m = torch.jit.load(str(path), map_location=DEVICE).eval()
    with torch.inference_mode():
        for _ in range(2):
            for b in (1, 8):
                m(torch.zeros(b, FEATURES, device=DEVICE))
    if DEVICE != "cpu":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - t0


def model_entry(
    rank: int, on_demand: bool, deadline_ms: float, resident: bool = False
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": f"m{rank}", "engine": "torch", "path": f"m{rank}.pt", "cpu_threads": 1,
        "device": DEVICE,
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
    resident: tuple[int, ...] = (), eviction: str = "cost",
) -> Path:  # fmt: skip
    config: dict[str, Any] = {
        "http": {"host": "127.0.0.1", "port": port},
        "models": [model_entry(k, budget_mib is not None, deadline_ms, k in resident)
                   for k in ranks],
    }  # fmt: skip
    if budget_mib is not None:
        config["devices"] = {DEVICE: {"memory_budget_mib": budget_mib, "eviction": eviction}}
        if PARK is not None:
            config["devices"][DEVICE]["park_evicted"] = PARK
    path = folder / (f"budget-{eviction}.json" if budget_mib is not None else "hot-only.json")
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
        """The server tree's RSS; on a GPU, what the device holds (every process's)."""
        if DEVICE != "cpu":
            free, total = torch.cuda.mem_get_info(DEVICE)
            return total - free
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
    """aserve_device_memory_used_bytes of the device, from /metrics (blocking)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    line = rf'^aserve_device_memory_used_bytes\{{device="{re.escape(DEVICE)}"\}} (\S+)$'
    m = re.search(line, text, re.M)
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

LOADED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: model (m\d+)/1 loaded on \S+ in ([\d.]+) s")
EVICTED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: evicting model (m\d+)/1 ")
WAITED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: model (m\d+)/1 waits up to ")
PARKED = re.compile(r"^(\S+ \S+) INFO aserve\.memory: model (m\d+)/1 parked on ")
RESTORED = re.compile(
    r"^(\S+ \S+) INFO aserve\.model: model (m\d+)/1 loaded from .*its weights read back"
)


def _log_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(path: Path, start: float, end: float) -> dict[str, Any]:
    loads: list[tuple[float, str, float]] = []
    evictions: list[tuple[float, str]] = []
    waits: list[tuple[float, str]] = []
    parks: list[tuple[float, str]] = []
    restores: list[tuple[float, str]] = []
    for line in path.read_text(errors="replace").splitlines():
        if m := LOADED.match(line):
            loads.append((_log_time(m.group(1)), m.group(2), float(m.group(3))))
        elif m := EVICTED.match(line):
            evictions.append((_log_time(m.group(1)), m.group(2)))
        elif m := WAITED.match(line):
            waits.append((_log_time(m.group(1)), m.group(2)))
        elif m := PARKED.match(line):
            parks.append((_log_time(m.group(1)), m.group(2)))
        elif m := RESTORED.match(line):
            restores.append((_log_time(m.group(1)), m.group(2)))
    # The log's clock has millisecond stamps; the window is the traffic's.
    loads = [x for x in loads if start - 1 <= x[0] <= end + 1]
    evictions = [x for x in evictions if start - 1 <= x[0] <= end + 1]
    waits = [x for x in waits if start - 1 <= x[0] <= end + 1]
    parks = [x for x in parks if start - 1 <= x[0] <= end + 1]
    restores = [x for x in restores if start - 1 <= x[0] <= end + 1]
    return {"loads": loads, "evictions": evictions, "waits": waits, "parks": parks,
            "restores": restores}  # fmt: skip


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


def load_spans(events: dict[str, Any]) -> list[tuple[float, float]]:
    """When the device was busy loading (wall clock): each load from the first
    eviction that made room for it (logged before it, under the device's lock)
    or its own start (its log line's time less its duration), to its end."""
    marks = sorted([(t, "evict", 0.0) for t, _ in events["evictions"]]
                   + [(t, "load", s) for t, _, s in events["loads"]])  # fmt: skip
    spans = []
    pending: float | None = None
    for t, kind, s in marks:
        if kind == "evict":
            pending = t if pending is None else pending
            continue
        spans.append((min(t - s, pending if pending is not None else t), t))
        pending = None
    return spans


def overlap(
    records: list[dict[str, Any]], spans: list[tuple[float, float]], models: list[str]
) -> dict[str, Any]:
    """``models``' requests answered in time, split by whether a load (of any
    model, with the evictions that made room for it: ``load_spans``) ran while
    they did."""
    spans = sorted(spans)
    starts = [a for a, _ in spans]
    longest = max((b - a for a, b in spans), default=0.0)
    during: list[float] = []
    clear: list[float] = []
    for r in records:
        if r["model"] not in models or not r["in_time"]:
            continue
        t0, t1 = r["t"], r["t"] + r["ms"] / 1e3
        # The spans that begin before t1 and may still run at t0.
        i = bisect.bisect_left(starts, t0 - longest)
        hit = any(a < t1 and b > t0 for a, b in spans[i : bisect.bisect_right(starts, t1)])
        (during if hit else clear).append(r["ms"])
    return {
        "during_a_load": {"count": len(during), "p50_ms": pct(during, 0.5),
                          "p99_ms": pct(during, 0.99)},
        "no_load": {"count": len(clear), "p50_ms": pct(clear, 0.5), "p99_ms": pct(clear, 0.99)},
    }  # fmt: skip


def budget_run(
    policy: str, ranks: list[int], weights: list[float], budget_mib: int, rate: float,
    duration_s: float, deadline_ms: float, folder: Path, resident: tuple[int, ...],
) -> dict[str, Any]:  # fmt: skip
    """One budgeted server with the eviction rule ``policy``, the whole traffic."""
    port = free_port()
    cfg = write_config(folder, port, ranks, budget_mib, deadline_ms, resident, policy)
    with serve(f"budget-{policy}", cfg, folder) as srv:
        base = f"http://127.0.0.1:{port}"
        sampler = Sampler(srv.pid, base)
        baseline = baseline_rss(sampler)
        sampler.start()
        # The hottest models loaded before the window, as the other server's are at
        # its start: their p99 is then the steady state's, not their first load's.
        # The coldest first: the first load in a process also holds torch's one-time
        # setup (about 12 MiB), counted in that load's footprint for as long as the
        # model stays loaded; a hot model the rule keeps would hold it all the run.
        asyncio.run(warm(base, [ranks[-1], *ranks[:HOT]]))
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
    hot = [f"m{k}" for k in ranks[:HOT]]
    return {
        "eviction": policy,
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
        "waits_for_a_cheaper_model": len(events["waits"]),
        "parks": len(events["parks"]),
        "restores": len(events["restores"]),
        "load_seconds_per_s": round(sum(s for _, _, s in events["loads"]) / (end - start), 3),
        "cold_loads_s": {k: [round(x, 3) for x in v] for k, v in sorted(loads_by_model.items(),
                                                                      key=lambda kv: int(kv[0][1:]))},
        "per_model": summarize(records, [f"m{k}" for k in ranks]),
        "hot_by_overlap": overlap(records, load_spans(events), hot),
        "hot_loads_at_s": {name: [round(t - start, 1) for t, n, _ in events["loads"] if n == name]
                           for name in hot},
    }  # fmt: skip


def run(
    duration_s: float, rate: float, deadline_ms: float, folder: Path, resident_hot: bool = False,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, Any]:  # fmt: skip
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
    results["budget_servers"] = {
        policy: budget_run(policy, ranks, weights, budget_mib, rate, duration_s, deadline_ms,
                           folder, resident)
        for policy in policies
    }  # fmt: skip

    hot = ranks[:HOT]
    hot_weights = [weights[k - 1] for k in hot]
    hot_rate = rate * sum(hot_weights)
    port = free_port()
    cfg = write_config(folder, port, hot, None, deadline_ms)
    with serve("hot-only", cfg, folder) as srv:
        base = f"http://127.0.0.1:{port}"
        # Sampled as the budgeted servers are (its RSS, /metrics every 0.5 s): the
        # same work beside the traffic.
        sampler = Sampler(srv.pid, base)
        sampler.start()
        ref = asyncio.run(traffic(base, hot, hot_weights, hot_rate, duration_s, deadline_ms,
                                  SEED + 1))  # fmt: skip
        sampler.stop()
    results["hot_only_server"] = {
        "rate": round(hot_rate, 2), "sent": len(ref), "not_ok": not_ok(ref),
        "per_model": summarize(ref, [f"m{k}" for k in hot]),
    }  # fmt: skip
    return results


# --- the report --------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _ratio(mine: float | None, ref: float | None) -> str:
    return f"{mine / ref:.2f}x" if mine and ref else "-"


def render(r: dict[str, Any]) -> str:
    servers, h = r["budget_servers"], r["hot_only_server"]
    names = list(servers)
    head = " | ".join(names)
    rule = "|".join(["---"] * (len(names) + 1))

    def row(label: str, values: list[Any]) -> str:
        return f"| {label} | " + " | ".join(str(v) for v in values) + " |"

    lines = [
        f"{len(r['models'])} models, budget {r['budget_mib']} MiB on the {r.get('device', 'cpu')} (about {FIT} of "
        f"their mean size), Zipf(1.0) open loop at {r['rate']:g} req/s for "
        f"{r['duration_s']:g} s, deadline {r['deadline_ms']:g} ms"
        + (f"; {', '.join(r['resident'])} marked resident." if r.get("resident") else "."),
        "",
        f"| eviction | {head} |",
        f"|{rule}|",
        row("budget (MiB)", [r["budget_mib"]] * len(names)),
        row("peak the server accounts to its models (MiB, /metrics every 0.5 s)",
            [servers[n]["peak_accounted_mib"] for n in names]),
        row("peak RSS less baseline (MiB, every 50 ms)",
            [f"{servers[n]['peak_rss_over_baseline_mib']} (baseline "
             f"{servers[n]['baseline_rss_mib']})" for n in names]),
        row("RSS less baseline beyond the account: median / max (MiB)",
            [f"{servers[n]['rss_beyond_account_mib']['median']} / "
             f"{servers[n]['rss_beyond_account_mib']['max']}" for n in names]),
        row("sent", [servers[n]["sent"] for n in names]),
        row("200 in time", [servers[n]["ok_in_time"] for n in names]),
    ]  # fmt: skip
    reasons = sorted({k for n in names for k in servers[n]["not_ok"]})
    lines += [row(k, [servers[n]["not_ok"].get(k, 0) for n in names]) for k in reasons]
    lines += [
        row("loads / min", [servers[n]["loads_per_min"] for n in names]),
        row("evictions / min", [servers[n]["evictions_per_min"] for n in names]),
        row("of the evictions: parked (weights released, module kept)",
            [servers[n].get("parks", 0) for n in names]),
        row("of the loads: restores (weights read back into a parked module)",
            [servers[n].get("restores", 0) for n in names]),
        row("loads that waited for a busy model cheaper to evict",
            [servers[n]["waits_for_a_cheaper_model"] for n in names]),
        row("seconds of loading a second", [servers[n]["load_seconds_per_s"] for n in names]),
        "",
        "| hot model | share | p99 serving only the 3 (ms) | "
        + " | ".join(f"{n}: p99 (ms), ratio, own loads" for n in names) + " |",
        f"|---|---|---|{'|'.join(['---'] * len(names))}|",
    ]  # fmt: skip
    for name, ref in h["per_model"].items():
        cells = []
        for n in names:
            mine = servers[n]["per_model"][name]
            own = len(servers[n]["cold_loads_s"].get(name, []))
            cells.append(f"{_ms(mine['p99_ms'])}, {_ratio(mine['p99_ms'], ref['p99_ms'])}, {own}")
        lines.append(
            f"| {name} | {r['models'][name]['share']:.3f} | {_ms(ref['p99_ms'])} | "
            + " | ".join(cells) + " |"
        )  # fmt: skip
    lines += [
        "",
        "| the 3 hot models' requests | " + " | ".join(f"{n}: count, p50, p99 (ms)" for n in names)
        + " |",
        f"|---|{'|'.join(['---'] * len(names))}|",
    ]  # fmt: skip
    for part, label in (("no_load", "no load ran meanwhile"), ("during_a_load", "a load ran")):
        cells = []
        for n in names:
            o = servers[n]["hot_by_overlap"][part]
            cells.append(f"{o['count']}, {_ms(o['p50_ms'])}, {_ms(o['p99_ms'])}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| model | MiB | share | in-process (s) | "
        + " | ".join(f"{n}: cold loads, median, max (s)" for n in names) + " |",
        f"|---|---|---|---|{'|'.join(['---'] * len(names))}|",
    ]  # fmt: skip
    for name, m in r["models"].items():
        cells = []
        for n in names:
            loads = servers[n]["cold_loads_s"].get(name, [])
            cells.append(
                f"{len(loads)}, {statistics.median(loads):.3f}, {max(loads):.3f}" if loads
                else "0, -, -"
            )  # fmt: skip
        lines.append(
            f"| {name} | {m['file_mib']:.1f} | {m['share']:.3f} | {m['in_process_load_s']:.3f} | "
            + " | ".join(cells) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, all models")
    p.add_argument("--deadline-ms", type=float, default=2000.0)
    p.add_argument("--resident-hot", action="store_true",
                   help="mark the 3 hottest models resident (never evicted)")  # fmt: skip
    p.add_argument("--policy", choices=("both", *POLICIES), default="both",
                   help="the device's eviction rule; both: one server each, in turn")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, or cuda:N: the models on that GPU")
    p.add_argument("--park", choices=("default", "on", "off"), default="default",
                   help="the device's park_evicted: its default, true or false")  # fmt: skip
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results-memory-budget.json")
    args = p.parse_args(argv)
    global DEVICE, PARK
    DEVICE = args.device
    PARK = None if args.park == "default" else args.park == "on"
    folder = Path(tempfile.mkdtemp(prefix="aserve-memory-"))
    try:
        policies = POLICIES if args.policy == "both" else (args.policy,)
        results = run(args.duration, args.rate, args.deadline_ms, folder, args.resident_hot,
                      policies)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results["command"] = "python -m bench.memory_budget " + " ".join(argv or sys.argv[1:])
    results["device"] = DEVICE
    results["park_evicted"] = PARK
    args.json.write_text(json.dumps(results, indent=2))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
