"""The gRPC row: one aserve process serving the tiny model over HTTP and gRPC, side by side.

    python -m bench.grpc_row [--duration 8] [--warmup 2] [--concurrency 1 16 64] [--channels 1]

The tiny model (``bench.models`` "tiny": y = x + 1 on 16 floats) is served by
ONE aserve process with HTTP and gRPC both on (one instance, ``cpu_threads``
1, max batch 32, max delay 2 ms, preferred 8/16/32). At each concurrency the
same server is driven first over HTTP (``bench.loadgen``, JSON body) and then
over gRPC (``bench.grpc_loadgen``, ``ModelInfer`` with ``raw_input_contents``),
then over gRPC's streaming RPC (``ModelStreamInfer``, one call per caller,
one request in flight on it), all closed-loop and run in this process under uvloop, after checking one
answer of each protocol against the model itself. The server's process-tree
CPU time is read at the edges of every window.

Writes ``RESULTS-grpc.md`` and ``results-grpc.json`` into ``--out-dir``
(default: bench/). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import grpc_floor, grpc_loadgen, loadgen
from bench.models import MODELS, default_cache_dir, expected_output, model_file, sample_input
from bench.proctree import system_busy_seconds, tree_cpu_seconds
from bench.report import row_facts
from bench.run import wait_for_quiet
from bench.servers import MODEL_ENV, ServerProcess, aserve_config, start_aserve

REPO = Path(__file__).resolve().parent.parent
_GRPC_LISTENING = re.compile(r"gRPC \(KServe V2\) listening on \S+:(\d+)")


def v2_body(values: list[float]) -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                       "data": values}]}  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


def grpc_port(server: ServerProcess, timeout_s: float = 60.0) -> int:
    """The gRPC port from the server's log (gRPC starts after HTTP)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(server.log):
            m = _GRPC_LISTENING.search(line)
            if m:
                return int(m.group(1))
        if server.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"aserve logged no gRPC port:\n{server.log_tail()}")


class _Edges:
    """Server CPU and machine busy time at a window's edges."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.values: dict[str, float] = {}

    def hook(self, edge: str) -> Callable[[], None]:
        def read() -> None:
            self.values[f"cpu_{edge}"] = tree_cpu_seconds(self.pid)
            self.values[f"busy_{edge}"] = system_busy_seconds()

        return read

    def add_to(self, out: dict[str, Any]) -> dict[str, Any]:
        v, window = self.values, out["duration_s"]
        server_cpu = v["cpu_end"] - v["cpu_start"]
        out["server_cpu_util"] = server_cpu / window
        out["server_cpu_ms_per_request"] = (
            1e3 * server_cpu / out["requests"] if out["requests"] else math.nan
        )
        busy = (v["busy_end"] - v["busy_start"]) / window
        out["other_cpu_util"] = busy - out["client_cpu_util"] - out["server_cpu_util"]
        return out


async def _measure(
    http_url: str,
    grpc_target: str,
    pid: int,
    values: list[float],
    expected: list[float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    body = v2_body(values)
    request = grpc_loadgen.build_request("tiny", values)
    status, reply = await loadgen.fetch_once(http_url, body)
    if status != 200:
        raise RuntimeError(f"HTTP: first request answered {status}: {reply[:300]!r}")
    loadgen.check_outputs(reply, expected)
    grpc_loadgen.check_outputs(await grpc_loadgen.infer_once(grpc_target, request), expected)
    points: dict[str, Any] = {}
    for c in args.concurrency:
        await asyncio.to_thread(wait_for_quiet, 0.15, args.quiet_wait)
        edges = _Edges(pid)
        http = await loadgen.run_load(
            http_url, body, c, args.duration, args.warmup,
            on_window_start=edges.hook("start"), on_window_end=edges.hook("end"),
        )  # fmt: skip
        h = edges.add_to(http.as_dict())
        await asyncio.to_thread(wait_for_quiet, 0.15, args.quiet_wait)
        edges = _Edges(pid)
        grpc = await grpc_loadgen.run_load(
            grpc_target, request, c, args.duration, args.warmup, channels=args.channels,
            on_window_start=edges.hook("start"), on_window_end=edges.hook("end"),
        )  # fmt: skip
        g = edges.add_to(grpc.as_dict())
        await asyncio.to_thread(wait_for_quiet, 0.15, args.quiet_wait)
        edges = _Edges(pid)
        streamed = await grpc_loadgen.run_load(
            grpc_target, request, c, args.duration, args.warmup, channels=args.channels,
            stream=True, on_window_start=edges.hook("start"), on_window_end=edges.hook("end"),
        )  # fmt: skip
        st = edges.add_to(streamed.as_dict())
        points[str(c)] = {"http": h, "grpc": g, "grpc_stream": st}
        for proto, r in (("http", h), ("grpc", g), ("stream", st)):
            print(
                f"  c={c:<3d} {proto:6s} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:.2f} ms  "
                f"p99 {r['p99_ms']:.2f} ms  errors {r['errors']}  client cpu "
                f"{r['client_cpu_util']:.0%}  server cpu {r['server_cpu_ms_per_request']:.3f} ms/req"
                f"  other {r['other_cpu_util']:.2f} cores",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        await asyncio.sleep(0.5)
    return points


def render(results: dict[str, Any]) -> str:
    f = results["facts"]
    lines = [
        "# gRPC row: the tiny model over HTTP and gRPC, one aserve process",
        "",
        f"Generated by `{f['command']}` on {f['date']} ({f['cpu']}, {f['cores']} cores; "
        f"Python {f['python']}, torch {f['torch']}, grpcio {f['grpcio']}). "
        f"Load average before {f['loadavg_before']}, after {f['loadavg_after']}.",
        "",
        f"Model: {results['model']}. aserve: one process with HTTP and gRPC, one instance, "
        "cpu_threads 1, max_batch_size 32, max_delay_ms 2, preferred 8/16/32. "
        f"Each point: {results['warmup_s']} s warm-up, then {results['duration_s']} s measured; "
        "closed loop, one request in flight per connection (HTTP: `bench.loadgen`, JSON body, "
        f"one keep-alive connection per caller) or per coroutine (gRPC: `bench.grpc_loadgen`, "
        f"`ModelInfer` with `raw_input_contents`, {results['channels']} channel(s); "
        "`ModelStreamInfer`: one call per coroutine, one request in flight on it). The load "
        "generators run in the bench process (uvloop) on the same 2 cores as the server; the "
        "first answer of each protocol was checked against the model.",
        "",
        "| c | protocol | req/s | / HTTP | p50 ms | p99 ms | errors | server CPU ms/req | "
        "loadgen CPU | other load, cores |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"http": "HTTP", "grpc": "gRPC ModelInfer", "grpc_stream": "gRPC ModelStreamInfer"}
    for c, p in results["points"].items():
        base = p["http"]["rps"]
        for proto, name in names.items():
            r = p.get(proto)
            if r is None:  # a run from before the streaming column
                continue
            lines.append(
                f"| {c} | {name} | {r['rps']:.0f} | {r['rps'] / base:.2f} | {r['p50_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {r['errors']} | {r['server_cpu_ms_per_request']:.3f} | "
                f"{r['client_cpu_util']:.0%} | {r['other_cpu_util']:.2f} |"
            )
    lines += [
        "",
        "Server CPU is the aserve process tree's user+system time in the window over the "
        "requests completed in it; loadgen CPU is the bench process's CPU seconds per wall "
        "second (1.0 = one core). With the client on the same two cores, a load generator "
        "that costs more CPU per request leaves less for the server: compare the columns "
        "together, not req/s alone. Every point first waits (up to 60 s) for the machine to "
        "be quiet (other load under 0.15 cores); the last column is what else kept the "
        "machine busy during it.",
        "",
    ]
    if results.get("floor"):
        lines += [
            "**The protocol floor** (`bench.grpc_floor`, run after the points above): echo "
            "servers that do nothing but answer a 200-byte body, each in its own process, with "
            "the same client shapes (gRPC: a generic handler on raw bytes, no protobuf on "
            "either side). Server CPU per call is what the library alone spends on one call "
            "of that shape.",
            "",
            "| c | echo server | calls/s | server CPU ms/call |",
            "|---:|---|---:|---:|",
        ]
        for r in results["floor"]:
            lines.append(
                f"| {r['concurrency']} | {r['kind']} | {r['calls_per_s']:.0f} | "
                f"{r['server_cpu_ms_per_call']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_row", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--channels", type=int, default=1, help="gRPC channels shared by the callers")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="seconds to wait for a quiet machine per point",
    )
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    torch.set_num_threads(1)
    import grpc

    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    model = MODELS["tiny"]
    cache = args.cache_dir or default_cache_dir()
    path = model_file(model, cache)
    values = sample_input(model)
    expected = expected_output(path, values)
    config = aserve_config("tiny", path.name, model.features)
    config["grpc"] = {"host": "127.0.0.1", "port": 0}
    cfg_path = path.parent / "tiny-grpc-row.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    print("grpc_row: starting aserve (HTTP + gRPC)", file=sys.stderr, flush=True)
    with start_aserve(cfg_path, REPO) as server:
        target = f"127.0.0.1:{grpc_port(server)}"
        url = f"{server.base_url}/v2/models/tiny/infer"
        points = runner(_measure(url, target, server.pid, values, expected, args))
    floor = []
    for c in args.concurrency:
        for kind in grpc_floor.KINDS:
            wait_for_quiet(0.15, args.quiet_wait)
            floor.append(grpc_floor.measure(kind, c, args.duration, args.warmup))
            print(f"  floor {floor[-1]}", file=sys.stderr, flush=True)
    results = {
        "facts": {**row_facts("bench.grpc_row", argv, loadavg_before), "grpcio": grpc.__version__},
        "model": model.description,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "channels": args.channels,
        "aserve_config": config,
        "points": points,
        "floor": floor,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results-grpc.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out_dir / "RESULTS-grpc.md").write_text(render(results))
    print(f"grpc_row: wrote {args.out_dir / 'RESULTS-grpc.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
