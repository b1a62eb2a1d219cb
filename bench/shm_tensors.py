"""A 12 MB tensor in and out of one host's aserve: JSON, the binary extension, system shared memory.

Issue 29, item 1's measurement. One aserve on one core (``taskset``), one
model that returns its input (a python handler: ``infer`` hands back the
array it was given, so the model copies nothing and the transport is what is
measured), input and output FP32 ``[1, 3, 1024, 1024]`` (12 MiB), max batch 1
(a batch of two would be concatenated, a 24 MB copy the identity does not need;
there is no per-batch cost to spread). Clients, threads of this process on
the other core, one request in flight each, closed loop, at c=1 and c=8:

- ``json``: the V2 JSON document, encoded and decoded with orjson over
  ``http.client`` (tritonclient's JSON path converts 3M elements one by one in
  Python: the client, not the server, would be measured);
- ``binary``: ``tritonclient.http``, input and output ``binary_data=True``;
- ``shm``: ``tritonclient.http`` with ``tritonclient.utils.shared_memory``: an
  input and an output region per client, registered before the timed loop;
  each request copies the input into its region
  (``set_shared_memory_region``) and takes the output as numpy from its
  region (``get_contents_as_numpy``, a view), as a user does. The copy in is
  the client's, counted in req/s and latency, not in the server's CPU.

Every client's first answer is checked against its input. Server CPU per
request is the server's user+system time (all its threads) over the
requests answered in the timed window; client CPU the same for this process.

    python -m bench.shm_tensors [--duration 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np
import orjson
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from bench.peers.launch import Plan, Running, free_port
from bench.proctree import system_busy_seconds, tree_cpu_seconds
from bench.report import row_facts, write_results
from bench.run import wait_for_quiet

REPO = Path(__file__).resolve().parent.parent
MODEL = "identity"
SHAPE = (1, 3, 1024, 1024)
NBYTES = int(np.prod(SHAPE)) * 4
SERVER_CORE, CLIENT_CORE = 1, 0
TRANSPORTS = ("json", "binary", "shm")
CONCURRENCY = (1, 8)
TARGET_RPS = 3.0  # shm / binary req/s at c=8, at least
TARGET_CPU = 0.2  # shm / binary server CPU per request at c=8, at most
NETWORK_TIMEOUT_S = 300.0

HANDLER = '''
class Identity:
    """INPUT0 -> OUTPUT0, the same array: nothing copied in the model."""

    def load(self, context):
        pass

    def preprocess(self, request):
        return {"x": request.inputs["INPUT0"]}

    def infer(self, batch):
        return {"y": batch["x"]}

    def postprocess(self, outputs, request):
        return {"OUTPUT0": outputs["y"]}
'''


def _config(folder: Path, port: int) -> Path:
    tensor = {"datatype": "FP32", "shape": list(SHAPE[1:])}
    config = {
        "http": {"host": "127.0.0.1", "port": port},
        # Eight JSON bodies of 33 MB at once are over the default 256 MiB of bodies
        # in flight (429s), and at c=8 a JSON request waits seconds for the seven
        # ahead of it: room for both, so that every point measures answers.
        "limits": {"max_inflight_bytes": 1 << 30},
        "models": [{
            "name": MODEL, "engine": "python", "handler": "identity:Identity",
            "inputs": [{"name": "INPUT0", **tensor}], "outputs": [{"name": "OUTPUT0", **tensor}],
            "batching": {"max_batch_size": 1, "timeout_ms": 120_000},
        }],
    }  # fmt: skip
    (folder / "identity.py").write_text(HANDLER)
    path = folder / "shm_tensors.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def _serve(folder: Path) -> Running:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["taskset", "-c", str(SERVER_CORE), sys.executable, "-m", "aserve",
            "--config", str(_config(folder, port)), "--log-level", "WARNING"]  # fmt: skip

    async def ready() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/v2/models/{MODEL}/ready") as r:
                return r.status, await r.read()

    plan = Plan("aserve", argv, f"{base}/v2/models/{MODEL}/infer", cwd=REPO, start_timeout_s=120)
    return Running(plan, b"", folder / "aserve.log", first=ready)


# --- the clients: one per thread, made and used on that thread only --------------------------


class Client(Protocol):
    def call(self) -> np.ndarray:
        """One request; the output as numpy."""
        ...

    def close(self) -> None: ...


class JsonClient:
    def __init__(self, port: int, index: int, x: np.ndarray) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=NETWORK_TIMEOUT_S)
        self._x = x

    def call(self) -> np.ndarray:
        doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(SHAPE),
                           "data": self._x.reshape(-1)}]}  # fmt: skip
        body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
        self._conn.request("POST", f"/v2/models/{MODEL}/infer", body,
                           {"Content-Type": "application/json"})  # fmt: skip
        resp = self._conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {raw[:300]!r}")
        out = orjson.loads(raw)["outputs"][0]
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])

    def close(self) -> None:
        self._conn.close()


class BinaryClient:
    def __init__(self, port: int, index: int, x: np.ndarray) -> None:
        self._client = httpclient.InferenceServerClient(
            f"127.0.0.1:{port}", connection_timeout=NETWORK_TIMEOUT_S,
            network_timeout=NETWORK_TIMEOUT_S,
        )  # fmt: skip
        self._x = x

    def call(self) -> np.ndarray:
        inp = httpclient.InferInput("INPUT0", list(SHAPE), "FP32")
        inp.set_data_from_numpy(self._x, binary_data=True)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        result = self._client.infer(MODEL, [inp], outputs=[out])
        arr = result.as_numpy("OUTPUT0")
        assert arr is not None
        return arr

    def close(self) -> None:
        self._client.close()


class ShmClient:
    """An input and an output region of its own, registered once."""

    def __init__(self, port: int, index: int, x: np.ndarray) -> None:
        self._client = httpclient.InferenceServerClient(
            f"127.0.0.1:{port}", connection_timeout=NETWORK_TIMEOUT_S,
            network_timeout=NETWORK_TIMEOUT_S,
        )  # fmt: skip
        self._x = x
        tag = f"{os.getpid()}_{index}_{uuid.uuid4().hex[:6]}"
        self._in, self._out = f"bench_in_{index}", f"bench_out_{index}"
        self._handles = []
        for name in (self._in, self._out):
            key = f"/aserve_bench_{name}_{tag}"
            self._handles.append(shm.create_shared_memory_region(name, key, NBYTES))
            self._client.register_system_shared_memory(name, key, NBYTES)

    def call(self) -> np.ndarray:
        h_in, h_out = self._handles
        shm.set_shared_memory_region(h_in, [self._x])
        inp = httpclient.InferInput("INPUT0", list(SHAPE), "FP32")
        inp.set_shared_memory(self._in, NBYTES)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(self._out, NBYTES)
        self._client.infer(MODEL, [inp], outputs=[out])
        arr: np.ndarray = shm.get_contents_as_numpy(h_out, np.float32, list(SHAPE))
        return arr

    def close(self) -> None:
        for name in (self._in, self._out):
            self._client.unregister_system_shared_memory(name)
        for handle in self._handles:
            shm.destroy_shared_memory_region(handle)
        self._client.close()


CLIENTS: dict[str, Callable[[int, int, np.ndarray], Client]] = {
    "json": JsonClient, "binary": BinaryClient, "shm": ShmClient,
}  # fmt: skip


# --- one point ---------------------------------------------------------------------------------


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Meter:
    """Wall, server CPU, client CPU and whole-machine busy time at a moment."""

    def __init__(self, server_pid: int) -> None:
        self.t = time.perf_counter()
        self.server = tree_cpu_seconds(server_pid)
        self.client = _own_cpu_s()
        self.busy = system_busy_seconds()


def run_point(
    transport: str, c: int, port: int, server_pid: int, x: np.ndarray,
    duration_s: float, warmup_s: float,
) -> dict[str, Any]:  # fmt: skip
    """``c`` clients of ``transport``: warm-up, then ``duration_s`` measured.

    Every client stops starting requests at the window's end and the window
    closes when the last one's answer is in, so every request counted was
    sent and answered inside it.
    """
    marks: dict[str, _Meter] = {}
    start = threading.Barrier(c + 1, action=lambda: marks.__setitem__("t0", _Meter(server_pid)))
    end = threading.Barrier(c, action=lambda: marks.__setitem__("t1", _Meter(server_pid)))
    latencies: list[list[float]] = [[] for _ in range(c)]
    errors: list[str] = []
    failed: list[str] = []

    def worker(i: int) -> None:
        client: Client | None = None
        try:
            client = CLIENTS[transport](port, i, x)
            warm_end = time.perf_counter() + warmup_s
            y = client.call()
            if not np.array_equal(y, x):
                raise RuntimeError(f"{transport} client {i}: the answer is not the input")
            while time.perf_counter() < warm_end:
                client.call()
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
            start.abort()
            if client is not None:
                client.close()
            return
        try:
            start.wait()
        except threading.BrokenBarrierError:  # another client's warm-up failed
            client.close()
            return
        stop = marks["t0"].t + duration_s
        mine = latencies[i]
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                client.call()
            except Exception as exc:  # a failed request: counted, and the loop goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            mine.append(time.perf_counter() - t)
        end.wait()
        client.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(c)]
    for t in threads:
        t.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        for t in threads:
            t.join(NETWORK_TIMEOUT_S)
        raise RuntimeError(f"{transport} c={c}: warm-up failed: {failed[:1]}") from None
    for t in threads:
        t.join()
    t0, t1 = marks["t0"], marks["t1"]
    wall = t1.t - t0.t
    lat = np.array([v for per in latencies for v in per]) * 1e3
    n = int(lat.size)
    server_s, client_s = t1.server - t0.server, t1.client - t0.client
    return {
        "transport": transport, "concurrency": c, "requests": n, "errors": len(errors),
        "first_error": errors[0] if errors else None, "window_s": round(wall, 3),
        "rps": n / wall,
        "p50_ms": float(np.percentile(lat, 50)) if n else None,
        "p99_ms": float(np.percentile(lat, 99)) if n else None,
        "server_cpu_ms_per_req": server_s / n * 1e3 if n else None,
        "client_cpu_ms_per_req": client_s / n * 1e3 if n else None,
        "server_cores": server_s / wall, "client_cores": client_s / wall,
        "other_cores": (t1.busy - t0.busy - server_s - client_s) / wall,
    }  # fmt: skip


def _copy_floor() -> dict[str, float]:
    """What one 12 MiB copy costs here (on the client's core): into memory touched
    already (a region, a buffer reused) and into new memory (``tobytes``, a fresh body)."""
    x = np.random.default_rng(1).random(SHAPE, dtype=np.float32)
    y = np.empty_like(x)
    np.copyto(y, x)
    t = time.perf_counter()
    for _ in range(20):
        np.copyto(y, x)
    into = (time.perf_counter() - t) / 20
    t = time.perf_counter()
    for _ in range(10):
        x.tobytes()
    fresh = (time.perf_counter() - t) / 10
    return {"copy_ms": into * 1e3, "tobytes_ms": fresh * 1e3}


def run(duration_s: float, warmup_s: float, folder: Path) -> dict[str, Any]:
    os.sched_setaffinity(0, {CLIENT_CORE})
    # An image's values: bytes over 255, as FP32 (what JSON has to spell out).
    x = (np.random.default_rng(0).integers(0, 256, SHAPE) / 255).astype(np.float32)
    results: dict[str, Any] = {
        "settings": {
            "shape": list(SHAPE), "bytes": NBYTES, "duration_s": duration_s,
            "warmup_s": warmup_s, "server_core": SERVER_CORE, "client_core": CLIENT_CORE,
            "max_batch_size": 1,
        },
        "floor": _copy_floor(),
        "points": [],
    }  # fmt: skip
    with _serve(folder) as srv:
        port = int(srv.plan.url.split(":")[2].split("/")[0])
        for c in CONCURRENCY:
            for transport in TRANSPORTS:
                quiet = wait_for_quiet(0.15, 30.0)
                point = run_point(transport, c, port, srv.pid, x, duration_s, warmup_s)
                point["quiet_before_cores"] = quiet
                results["points"].append(point)
                print(_row(point), file=sys.stderr, flush=True)
        results["server_peak_rss_mib"] = srv.peak_rss / 2**20
    results["ratios"] = _ratios(results["points"])
    return results


def _ratios(points: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(p["transport"], p["concurrency"]): p for p in points}
    out: dict[str, Any] = {}
    for c in CONCURRENCY:
        s, b = by.get(("shm", c)), by.get(("binary", c))
        if not s or not b or not s["requests"] or not b["requests"]:
            continue
        out[str(c)] = {
            "rps": s["rps"] / b["rps"],
            "server_cpu": s["server_cpu_ms_per_req"] / b["server_cpu_ms_per_req"],
        }
    return out


# --- the report --------------------------------------------------------------------------------


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _row(p: dict[str, Any]) -> str:
    return (f"| {p['transport']} | {p['concurrency']} | {_f(p['rps'])} | {_f(p['p50_ms'])} | "
            f"{_f(p['p99_ms'])} | {p['requests']} | {p['errors']} | "
            f"{_f(p['server_cpu_ms_per_req'], 2)} | {_f(p['client_cpu_ms_per_req'], 2)} | "
            f"{_f(p['server_cores'], 2)} | {_f(p['client_cores'], 2)} | {_f(p['other_cores'], 2)} |")  # fmt: skip


def render(r: dict[str, Any], notes: str) -> str:
    f, s = r["facts"], r["settings"]
    lines = [
        "# A 12 MB tensor through JSON, the binary extension and system shared memory",
        "",
        f"Generated by `{f['command']}` on {f['date']} ({f['cpu']}, {f['cores']} cores; "
        f"Python {f['python']}). Load average before {f['loadavg_before']}, after "
        f"{f['loadavg_after']}.",
        "",
        f"One aserve, pinned to core {s['server_core']}; the model returns its input (a python "
        "handler; nothing copied in the model), FP32 `[1, 3, 1024, 1024]` (12 MiB) in and out, "
        f"max batch {s['max_batch_size']}. Clients: threads of the bench process on core "
        f"{s['client_core']}, one request in flight each; {s['warmup_s']:g} s warm-up, then "
        f"{s['duration_s']:g} s measured (the window closes at the last answer). JSON: orjson "
        "over `http.client`; binary: `tritonclient.http`, input and output `binary_data=True`; "
        "shm: `tritonclient.http` with an input and an output region per client, registered "
        "before the window; each request copies the input into its region (counted in req/s "
        "and latency, on the client's CPU) and reads the output region as a numpy view. "
        "The first answer of every client was checked against its input.",
        "",
        "| transport | c | req/s | p50 ms | p99 ms | requests | errors | server CPU ms/req "
        "| client CPU ms/req | server cores | client cores | other load, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(p) for p in r["points"]),
        "",
        "Server CPU: the server process's user+system time (all threads) in the window over "
        "the requests answered in it; client CPU the same for the bench process (all client "
        "threads); cores: CPU seconds per second of the window (1.0: the whole core either "
        "side has). Other load: the machine's busy time in the window less both (someone "
        f"else's work). One 12 MiB copy here: {r['floor']['copy_ms']:.2f} ms into memory "
        f"touched already, {r['floor']['tobytes_ms']:.2f} ms into new memory (`tobytes`). "
        f"Server peak RSS {r.get('server_peak_rss_mib', 0):.0f} MiB.",
        "",
        "**Against the targets** (shared memory over the binary extension):",
        "",
        "| c | req/s ratio | target | server CPU/req ratio | target |",
        "|---:|---:|---|---:|---|",
    ]
    for c, ratio in r["ratios"].items():
        at8 = c == "8"
        rps_t = (f">= {TARGET_RPS:g}: **{'met' if ratio['rps'] >= TARGET_RPS else 'not met'}**"
                 if at8 else "-")  # fmt: skip
        cpu_t = (f"<= {TARGET_CPU:g}: **{'met' if ratio['server_cpu'] <= TARGET_CPU else 'not met'}**"
                 if at8 else "-")  # fmt: skip
        lines.append(
            f"| {c} | {ratio['rps']:.2f} | {rps_t} | {ratio['server_cpu']:.3f} | {cpu_t} |"
        )
    lines += ["", notes, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per point")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per point")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench")
    args = p.parse_args(argv)
    loadavg = [round(v, 2) for v in os.getloadavg()]
    cores = len(os.sched_getaffinity(0))  # before run() pins this process to one
    folder = Path(tempfile.mkdtemp(prefix="aserve-shm-tensors-"))
    try:
        results = run(args.duration, args.warmup, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results["facts"] = {**row_facts("bench.shm_tensors", argv, loadavg), "cores": cores}
    md = write_results(args.out_dir, "shm-tensors", results, render)
    print(f"shm_tensors: wrote {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
