"""Server memory and loop latency while big request bodies arrive at once.

One aserve process serves a python handler that reads every byte it gets
(a checksum); ``--clients`` clients each POST one body of ``--mb`` MB at the
same moment, ``--rounds`` times: a ``multipart/form-data`` body with one
file part to ``/predictions`` (``--route predictions``), or one BYTES
tensor in the binary extension to V2 infer (``--route v2``). While they
run, the server's RSS is sampled every few milliseconds and
``/v2/health/live`` is polled one request after another, on a connection
and from a process of their own (the clients' own sends copy big buffers on
their loop). Printed per round: the server's RSS before, at its peak and
after the answers (once the allocator has had ``--settle-s`` to give memory
back), the answers by status (429: ``limits.max_inflight_bytes``), and the
probes' max, p99 and p50.

    python -m bench.multipart_memory                      # this checkout
    python -m bench.multipart_memory --route v2
    python -m bench.multipart_memory --tree /path/to/other/checkout
    python -m bench.multipart_memory --config-limits '{"max_inflight_bytes": 1000000000}'

``--tree`` runs the server from another checkout (a ``git archive`` of the
commit to compare with), with this environment's Python. ``--config-limits``
is merged into the config's ``limits`` (the bound's default takes 4 of 8
bodies of 60 MB; raise it to measure all 8 at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
BOUNDARY = "benchB0undary"

HANDLER = """
import zlib

import numpy as np


class Parts:
    def load(self, context):
        pass

    def preprocess(self, request):
        texts = request.inputs["DATA"].reshape(-1)
        request.state["crc"] = [zlib.crc32(t) for t in texts]
        return {"n": np.array([[sum(len(t) for t in texts)]], np.int64)}

    def preprocess_raw(self, request):
        body = request.body
        parts = body if isinstance(body, list) else []
        request.state["crc"] = [zlib.crc32(p.data) for p in parts]
        return {"n": np.array([[sum(len(p.data) for p in parts)]], np.int64)}

    def infer(self, batch):
        return {"n": batch["n"]}

    def postprocess(self, outputs, request):
        return {"N": outputs["n"]}

    def postprocess_raw(self, outputs, request):
        return {"bytes": int(outputs["n"][0, 0]), "crc": request.state["crc"]}
"""


def body_of(size: int, route: str) -> tuple[bytes, dict[str, str], str]:
    """The body of one request to ``route``, its headers and its path."""
    data = os.urandom(1 << 20) * (size >> 20) + os.urandom(size & ((1 << 20) - 1))
    if route == "v2":  # one BYTES element, in the binary tensor extension
        header = json.dumps(
            {"inputs": [{"name": "DATA", "shape": [1, 1], "datatype": "BYTES",
                         "parameters": {"binary_data_size": 4 + size}}]}
        ).encode()  # fmt: skip
        body = header + size.to_bytes(4, "little") + data
        return body, {"Inference-Header-Content-Length": str(len(header))}, "/v2/models/parts/infer"
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    body = head + data + f"\r\n--{BOUNDARY}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}, "/predictions/parts"


class RssSampler:
    """The server's RSS every ``interval_s``, on a thread of its own."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self._proc = psutil.Process(pid)
        self._interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self._proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _probe_health(base: str, stop: Any) -> list[float]:
    times = []
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.get(base + "/v2/health/live") as r:
                await r.read()
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(0.002)
    return times


def probe_health(base: str, stop: Any, out: Any) -> None:
    """In a process of its own: the clients' sends (a 60 MB write is copied on their
    loop) and their GIL must not be what the probes measure."""
    out.put(asyncio.run(_probe_health(base, stop)))


async def one_round(
    base: str, request: tuple[bytes, dict[str, str], str], clients: int
) -> tuple[dict[int, int], list[float]]:
    body, headers, path = request
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=probe_health, args=(base, stop, out), daemon=True)
    prober.start()
    await asyncio.sleep(1.0)  # the prober's start, and a few quiet probes
    statuses: dict[int, int] = {}

    async def post() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                base + path, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=300)
            ) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

    await asyncio.gather(*(post() for _ in range(clients)))
    stop.set()
    times = await asyncio.to_thread(out.get, True, 60)
    prober.join(10)
    return statuses, times


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    tree = Path(args.tree).resolve() if args.tree else ROOT
    size = int(args.mb * 1e6)
    request = body_of(size, args.route)
    body = request[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "parts_handler.py").write_text(textwrap.dedent(HANDLER))
        limits = {"max_request_bytes": max(64 << 20, len(body) + 1024)}
        limits.update(json.loads(args.config_limits))
        config = {
            "drain_grace_s": 0,
            "limits": limits,
            "models": [
                {
                    "name": "parts", "engine": "python", "handler": "parts_handler:Parts",
                    "inputs": [{"name": "DATA", "datatype": "BYTES", "shape": [1]}],
                    "outputs": [{"name": "N", "datatype": "INT64", "shape": [1]}],
                }
            ],
        }  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        argv = [sys.executable, "-m", "aserve", "--config", str(folder / "config.json"),
                "--port", "0"]  # fmt: skip
        env_path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(tree) + (os.pathsep + env_path if env_path else "")
        try:
            server = ServerProcess("aserve", argv, tree)
        finally:
            if env_path is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = env_path
        rows = []
        with server:
            for i in range(args.rounds):
                sampler = RssSampler(server.pid)
                before = sampler.rss()
                t0 = time.perf_counter()
                with sampler:
                    statuses, health = asyncio.run(
                        one_round(server.base_url, request, args.clients)
                    )
                wall = time.perf_counter() - t0
                time.sleep(args.settle_s)
                after = sampler.rss()
                health.sort()
                row = {
                    "round": i + 1,
                    "rss_before_mb": before / 1e6,
                    "rss_peak_mb": sampler.peak / 1e6,
                    "rss_after_mb": after / 1e6,
                    "statuses": statuses,
                    "health_max_ms": health[-1] * 1e3,
                    "health_p99_ms": health[int(0.99 * (len(health) - 1))] * 1e3,
                    "health_p50_ms": statistics.median(health) * 1e3,
                    "probes": len(health),
                    "wall_s": wall,
                }
                rows.append(row)
                print(
                    f"round {row['round']}: RSS {row['rss_before_mb']:.0f} -> peak "
                    f"{row['rss_peak_mb']:.0f} -> after {row['rss_after_mb']:.0f} MB; "
                    f"answers {statuses}; health max {row['health_max_ms']:.0f} ms, p99 "
                    f"{row['health_p99_ms']:.0f} ms, p50 {row['health_p50_ms']:.1f} ms "
                    f"({row['probes']} probes); {wall:.1f} s",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--mb", type=float, default=60.0, help="each body's size, MB (1e6 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--tree", help="run the server from this checkout instead")
    parser.add_argument("--config-limits", default="{}", help="JSON merged into limits")
    parser.add_argument(
        "--route", choices=["predictions", "v2"], default="predictions",
        help="multipart to /predictions, or one BYTES tensor (binary) to /v2/.../infer",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print(f"{args.clients} clients x {args.mb:g} MB bodies to {args.route}, {args.rounds} rounds")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
