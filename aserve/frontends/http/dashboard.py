"""``GET /``: the live dashboard, and ``GET /v2/dashboard/stats``, the JSON it polls (frontends layer, on the loop).

The page is ``dashboard.html`` beside this module (package data): hand-written
JS drawing SVG, no external assets, since the server may be offline. It is
read once, when the routes are added, and served as bytes.

The stats are cumulative counters and current gauges, stamped with the
server's monotonic clock; the page diffs its successive polls into rates
(requests/s, tokens/s, CPU), means (batch size) and windowed percentiles
(latency, from histogram bucket deltas, as Prometheus' ``histogram_quantile``
does) and a latency CDF over the charts' window. One poll costs a walk over
the models and their request counters (microseconds). ``?history=1`` adds
the server's ring of past snapshots (:mod:`aserve.frontends.http.dashboard_history`),
which the page asks for once, so that it shows the last ``dashboard.history_s``
seconds from the moment it opens. A python handler's custom metrics come
summed for the charts (a counter's total, a histogram's buckets over every
label value, a gauge's first three series); ``/metrics`` has every series.
Each shared device comes with its slots, its waiting models and its last
batches (the page's strip of which model ran when, drawn from the live poll;
the ring's snapshots leave the batches out), and each device with a memory
budget with what its models hold against it.

Auth: ``/`` carries no data, and the stats say no more than ``/metrics``;
both are in ``auth.open_paths`` by default, as ``/metrics`` is. An operator
who closes the stats (lists ``open_paths`` without it) still has a usable
page: on a 401 it asks for a key and sends it as ``Authorization: Bearer``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve import __version__
from aserve.frontends.http.dashboard_history import DashboardHistory
from aserve.frontends.http.kit import RouteKit, json_response
from aserve.frontends.status import OK
from aserve.obs.handler_metrics import MetricSet
from aserve.obs.stats import LATENCY_BUCKETS_S

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext

PAGE_PATH = "/"
STATS_PATH = "/v2/dashboard/stats"
GAUGE_SERIES = 3  # a gauge's series the page draws (it has three colours)


def add_dashboard_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    page = resources.files("aserve.frontends.http").joinpath("dashboard.html").read_bytes()
    cfg = ctx.config.dashboard
    # The ring's snapshots leave the devices' timelines out: the page draws the strip
    # from the live poll only, and 512 batches a device in each of its snapshots would
    # make the ring megabytes.
    history = DashboardHistory(
        lambda: dashboard_stats(ctx, timeline=False), cfg.history_s, cfg.sample_interval_s
    )
    kit.app.cleanup_ctx.append(history.lifetime)

    async def dashboard(request: web.Request) -> web.Response:
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            # The page only fetches its own origin's stats; nothing else may load.
            headers={
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
                "Cache-Control": "no-cache",
            },
        )

    async def stats(request: web.Request) -> web.Response:
        doc = dashboard_stats(ctx)
        if request.query.get("history") not in ("1", "true"):
            return json_response(doc)
        # The ring is JSON already: spliced in, not decoded and encoded again.
        body = orjson.dumps(doc)[:-1] + b',"history":' + history.json() + b"}"
        return web.Response(body=body, content_type="application/json")

    kit.route("GET", PAGE_PATH, dashboard)
    kit.route("GET", STATS_PATH, stats)


def dashboard_stats(ctx: FrontendContext, timeline: bool = True) -> dict[str, Any]:
    """One snapshot: cumulative counters and gauges per model, the process, its GPUs, the
    shared devices (with ``timeline``: the last batches each ran) and the memory budgets."""
    # Answered requests per model version, all protocols: (all, not ok).
    answered: dict[tuple[str, str], list[int]] = {}
    for (model, version, _protocol, status), n in ctx.metrics.requests.counts.items():
        entry = answered.setdefault((model, version), [0, 0])
        entry[0] += n
        if status != OK:
            entry[1] += n
    durations = ctx.metrics.requests.durations
    models = []
    for rt in sorted(ctx.registry, key=lambda rt: (rt.name, int(rt.version))):
        key = (rt.name, rt.version)
        doc = rt.statistics()
        st = rt.stats
        total, errors = answered.get(key, (0, 0))
        latency = durations.get(key)
        gen = doc.get("generation")
        models.append(
            {
                "name": rt.name,
                "version": rt.version,
                "ready": rt.ready,
                "requests": total,
                "errors": errors,
                # Successful requests' end-to-end latency, per bucket (not cumulative).
                "latency_counts": list(latency.counts) if latency else None,
                # Batches (decoders: engine steps) and the items in them (sequences).
                "executions": st.execution_count,
                "batch_items": st.inference_count,
                "queued": doc["pending_request_count"],
                "running": doc["running_batch_count"],
                "generated_tokens": None if gen is None else gen["generated_tokens"],
                "running_sequences": None if gen is None else gen["running_sequence_count"],
                "custom": custom_metrics(rt.handler_metrics),
            }
        )
    cpu_seconds, rss_bytes, rss_is_peak = process_usage()
    # Decoder models' step processes and batched models' worker processes: their
    # CPU and memory are the server's too.
    child_pids = [pid for rt in ctx.registry for pid in rt.worker_pids]
    for pid in child_pids:
        child = child_usage(pid)
        if child is not None:
            cpu_seconds += child[0]
            if rss_bytes is not None:
                rss_bytes += child[1]
    return {
        "version": __version__,
        "t": time.monotonic(),  # what the page diffs against: rates use the server's clock
        "time": time.time(),
        "latency_bounds_s": LATENCY_BUCKETS_S,
        "history_s": ctx.config.dashboard.history_s,
        "sample_interval_s": ctx.config.dashboard.sample_interval_s,
        "models": models,
        "process": {
            "cpu_seconds": cpu_seconds,
            "cpu_count": os.cpu_count() or 1,
            "rss_bytes": rss_bytes,
            "rss_is_peak": rss_is_peak,
            "child_processes": len(child_pids),  # included in cpu_seconds and rss_bytes
        },
        # Shared devices: slots busy, who waits, the last batches each slot ran.
        "devices": ctx.devices.snapshot(timeline=timeline),
        "memory": memory_stats(ctx.memory),
        "gpus": [
            {
                "index": index,
                "uuid": uuid,
                "utilization": util,
                "memory_used_bytes": used,
                "memory_total_bytes": size,
            }
            for index, uuid, util, used, size in ctx.metrics.nvml.samples
        ],
    }


# What the stats carry of each model in the memory budget's snapshot (its load time
# histogram stays on /metrics: it is an object, not JSON).
MEMORY_MODEL_FIELDS = ("name", "version", "device", "state", "footprint_mib", "loads", "evictions")


def memory_stats(snapshot: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """Each device's memory budget (None: none) and the MiB its loaded models hold, and
    each model's last measured footprint, state, loads and evictions."""
    if snapshot is None:
        return {"devices": [], "models": []}
    doc = snapshot()
    return {
        "devices": [
            {"name": d["name"], "budget_mib": d["budget_mib"], "used_mib": d["used_mib"]}
            for d in doc["devices"]
        ],
        "models": [{k: m[k] for k in MEMORY_MODEL_FIELDS} for m in doc["models"]],
    }


def custom_metrics(metric_set: MetricSet | None) -> list[dict[str, Any]]:
    """A handler's metrics as the page charts them: bounded, whatever the label values."""
    if metric_set is None:
        return []
    out = []
    for doc in metric_set.snapshot():
        series = doc["series"]
        entry: dict[str, Any] = {
            "name": doc["name"], "kind": doc["kind"], "help": doc["help"], "series": len(series),
        }  # fmt: skip
        if doc["kind"] == "counter":
            entry["total"] = sum(v for _, v in series)
        elif doc["kind"] == "gauge":
            entry["values"] = [[",".join(values), v] for values, v in series[:GAUGE_SERIES]]
        else:
            counts = [0] * (len(doc["buckets"]) + 1)
            for _, (c, _) in series:
                counts = [a + b for a, b in zip(counts, c, strict=True)]
            entry["bounds"] = doc["buckets"]
            entry["counts"] = counts
        out.append(entry)
    return out


def process_usage() -> tuple[float, int | None, bool]:
    """(CPU seconds of every thread of the process, resident bytes, whether that is the peak).

    Without a new dependency: ``time.process_time`` is portable; the current
    RSS comes from ``/proc/self/statm`` (one small procfs read, microseconds)
    where there is one, else the peak RSS from ``getrusage``, said to be one.
    """
    cpu = time.process_time()
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
        return cpu, pages * os.sysconf("SC_PAGE_SIZE"), False
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return cpu, None, False
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return cpu, peak if sys.platform == "darwin" else peak * 1024, True  # macOS: bytes, else KiB


def child_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of a child process, from procfs; None without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Fields after the parenthesised name: utime and stime are the 12th and 13th.
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, pages * os.sysconf("SC_PAGE_SIZE")
