"""N aserve replicas behind HAProxy on loopback: rolling restart, scale-up,
config change and a crash, under steady load, counting every failed request.

HAProxy stands in for a Kubernetes Service with readiness probes: it health
checks ``/v2/health/ready`` on each replica and does not retry a failed
request (``retries 0``, no ``option redispatch``): a request that fails
reaches the client. Each step waits on HAProxy's own view of the replicas
(its stats socket, ``show stat``), never on a sleep. The replicas'
``drain_grace_s`` is longer than HAProxy's ``inter`` x ``fall``, so HAProxy
marks a stopping replica DOWN before its listeners close, as the "Drain"
section of docs/deployment.md says to size it.

Scenarios (each reports requests answered, failed, p99 during the event):

- ``rolling``: every replica in turn: SIGTERM, wait for its exit, start a new
  one on the same port, wait until HAProxy shows it UP;
- ``scale``: a replica more (its server entry is DOWN until it is ready);
- ``config``: a config change written to every replica's ConfigMap-style
  directory (the kubelet's ``..data`` symlink swap), applied by each
  replica's watcher without a restart;
- ``kill``: SIGKILL of one replica: only its requests in flight may fail;
  reports how many and how long until HAProxy marked it DOWN; then it is
  started again.

Usage::

    python -m bench.cluster [--replicas 3] [--concurrency 32] [--steady-s 2]
        [--scenarios rolling,scale,config,kill] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.loadgen import Target, _Connection, _Window, build_request, percentile

MODEL = "affine"
BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
).encode()
CHECK_INTER_MS = 100  # HAProxy's health check interval
CHECK_FALL = 2  # failed checks before DOWN
CHECK_RISE = 2  # passed checks before UP
DRAIN_GRACE_S = 1.5  # > CHECK_INTER_MS x CHECK_FALL, with room for a busy machine
STEP_TIMEOUT_S = 120.0
SCENARIOS = ("rolling", "scale", "config", "kill")


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- a ConfigMap-style folder ---------------------------------------------------


def configmap_write(mount: Path, files: dict[str, bytes]) -> None:
    """Publish ``files`` in ``mount`` as the kubelet does: a new timestamped
    folder, one atomic rename of the ``..data`` symlink, the old folder deleted."""
    mount.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    new = Path(tempfile.mkdtemp(prefix=f"..{now:%Y_%m_%d_%H_%M_%S}.", dir=mount))
    for name, data in files.items():
        (new / name).write_bytes(data)
    data_link = mount / "..data"
    old = data_link.readlink() if data_link.is_symlink() else None
    os.symlink(new.name, mount / "..data_tmp")
    os.replace(mount / "..data_tmp", data_link)
    for name in files:
        if not (mount / name).is_symlink():
            os.symlink(f"..data/{name}", mount / name)
    if old is not None:
        shutil.rmtree(mount / old)


def replica_config(instances: int = 1) -> dict[str, Any]:
    return {
        "drain_grace_s": DRAIN_GRACE_S,
        "drain_timeout_s": 30,
        "models": [
            {
                "name": MODEL,
                "engine": "torch",
                "path": "builtin:affine",
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
                "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
                "instances": instances,
                "batching": {"max_batch_size": 32, "max_delay_ms": 1.0},
            }
        ],
    }


# --- replicas and HAProxy ------------------------------------------------------------


class Replica:
    """One aserve process on a fixed port, its config in a ConfigMap-style folder."""

    def __init__(self, name: str, port: int, root: Path) -> None:
        self.name = name
        self.port = port
        self.mount = root / name / "config"
        self.cache = root / "cache"
        self.log_path = root / name / "log.txt"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "ASERVE_CACHE_DIR": str(self.cache),
            "OMP_NUM_THREADS": "1",
        }
        log = self.log_path.open("ab")
        argv = [sys.executable, "-m", "aserve", "--config", str(self.mount / "config.json")]
        self.proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(self.port), "--watch-interval", "0.2"],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        log.close()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = STEP_TIMEOUT_S) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def config_hash(self) -> str | None:
        url = f"http://127.0.0.1:{self.port}/v2/config/status"
        with urllib.request.urlopen(url, timeout=5) as r:
            status = json.loads(r.read())
        last = status.get("last_reload") or {}
        return status["config_hash"] if last.get("result", "ok") == "ok" else None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class HAProxy:
    """HAProxy in front of the replicas, with an admin stats socket."""

    def __init__(self, binary: str, root: Path, replicas: list[Replica]) -> None:
        self.port = free_port()
        self.socket_path = root / "haproxy.sock"
        cfg = root / "haproxy.cfg"
        servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port}" for r in replicas)
        cfg.write_text(f"""\
global
    maxconn 4000
    stats socket {self.socket_path} mode 600 level admin

defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout check 2s
    # Like a Kubernetes Service: a request that fails is not retried elsewhere.
    retries 0
    option http-keep-alive

frontend fe
    bind 127.0.0.1:{self.port}
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /v2/health/ready
    http-check expect status 200
    default-server check inter {CHECK_INTER_MS}ms fall {CHECK_FALL} rise {CHECK_RISE}
{servers}
""")
        self.last_before: dict[str, dict[str, str]] = {}
        self.log_path = root / "haproxy.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start: {self.log_path.read_text()}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v2/models/{MODEL}/infer"

    def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the replicas' backend: server name -> its row."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.socket_path))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        text = data.decode().lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            row["svname"]: row
            for row in rows
            if row["pxname"] == "replicas" and row["svname"] not in ("BACKEND", "FRONTEND")
        }

    def status(self, name: str) -> str:
        return self.stats()[name]["status"]

    def wait_status(self, name: str, want: str, timeout_s: float = STEP_TIMEOUT_S) -> float:
        """Poll until HAProxy shows ``name`` as ``want`` (UP/DOWN); returns the seconds it took.
        ``self.last_before[name]`` keeps the last row that showed another status."""
        t0 = time.monotonic()
        while True:
            row = self.stats()[name]
            status = row["status"]
            if status == want:
                return time.monotonic() - t0
            self.last_before[name] = row
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{name} stayed {status}, not {want}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# --- steady load, cut into events ------------------------------------------------------


@dataclass(frozen=True)
class EventResult:
    scenario: str
    seconds: float
    requests: int  # answered (any status) or failed during the event
    failed: int  # not a 200: HAProxy's 5xx, a connection lost
    p99_ms: float
    statuses: dict[int, int]
    notes: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SteadyLoad:
    """``concurrency`` closed-loop keep-alive connections through HAProxy,
    recording all the time; :meth:`mark` and :meth:`since` cut out an event."""

    def __init__(self, url: str, concurrency: int) -> None:
        self._target = Target.parse(url)
        self._request = build_request(self._target, BODY, "application/json", None)
        self._concurrency = concurrency
        self.window = _Window()
        self._conns: list[_Connection] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.window.recording = True
        await asyncio.gather(*(self._connect() for _ in range(self._concurrency)))

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: _Connection(self._request, self.window, self._on_lost),
            self._target.host,
            self._target.port,
        )
        self._conns.append(proto)

    def _on_lost(self) -> None:
        task = asyncio.get_running_loop().create_task(self._connect())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until every open connection has had an answer to the request it has
        in flight now (or closed): what was sent before this moment is counted."""
        waiting = [(c, c.answered) for c in self._conns if not c.closed]
        deadline = time.monotonic() + timeout_s
        while any(not c.closed and c.answered == n for c, n in waiting):
            if time.monotonic() > deadline:
                raise TimeoutError("requests in flight were not answered")
            await asyncio.sleep(0.01)

    def mark(self) -> tuple[float, int, int, dict[int, int]]:
        w = self.window
        return time.monotonic(), len(w.latencies_ns), w.errors, dict(w.statuses)

    def since(self, scenario: str, mark: Any, notes: dict[str, Any]) -> EventResult:
        t0, n0, e0, s0 = mark
        w = self.window
        lat = sorted(ns / 1e6 for ns in w.latencies_ns[n0:])
        failed = w.errors - e0
        statuses = {k: v - s0.get(k, 0) for k, v in w.statuses.items() if v - s0.get(k, 0)}
        return EventResult(
            scenario=scenario,
            seconds=round(time.monotonic() - t0, 2),
            requests=len(lat) + failed,
            failed=failed,
            p99_ms=round(percentile(lat, 99), 2),
            statuses=statuses,
            notes=notes,
        )

    async def stop(self) -> None:
        self.window.stopping = True
        for conn in self._conns:
            conn.close()
        for task in list(self._tasks):
            task.cancel()


# --- the cluster and its scenarios ---------------------------------------------------------


class Cluster:
    def __init__(self, root: Path, replicas: int, spare: int = 0) -> None:
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
        self.root = root
        self.replicas = [Replica(f"r{i}", free_port(), root) for i in range(replicas + spare)]
        self.active = self.replicas[:replicas]
        for r in self.replicas:
            configmap_write(r.mount, {"config.json": json.dumps(replica_config()).encode()})
        self.haproxy = HAProxy(binary, root, self.replicas)

    def start(self) -> None:
        for r in self.active:
            r.start()
        for r in self.active:
            self.haproxy.wait_status(r.name, "UP")
        for r in self.replicas[len(self.active) :]:
            self.haproxy.wait_status(r.name, "DOWN")  # spares: not started, not routed

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.haproxy.stop()


async def _off_loop(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def rolling(cluster: Cluster, load: SteadyLoad, steady_s: float) -> EventResult:
    mark = load.mark()
    notes: dict[str, Any] = {"down_after_s": [], "exit_codes": [], "up_after_s": []}
    for r in list(cluster.active):
        r.signal(signal.SIGTERM)
        notes["down_after_s"].append(
            round(await _off_loop(cluster.haproxy.wait_status, r.name, "DOWN"), 2)
        )
        notes["exit_codes"].append(await _off_loop(r.wait_exit))
        r.start()
        notes["up_after_s"].append(
            round(await _off_loop(cluster.haproxy.wait_status, r.name, "UP"), 2)
        )
    await asyncio.sleep(steady_s)  # load on the new replicas, within the event
    return load.since("rolling", mark, notes)


async def scale(cluster: Cluster, load: SteadyLoad, steady_s: float) -> EventResult:
    spare = cluster.replicas[len(cluster.active)]
    before = int(cluster.haproxy.stats()[spare.name]["stot"])
    mark = load.mark()
    spare.start()
    up_s = await _off_loop(cluster.haproxy.wait_status, spare.name, "UP")
    cluster.active.append(spare)
    # Requests HAProxy sent it while it was not UP yet: up to its last row that said so.
    at_up = int(cluster.haproxy.last_before.get(spare.name, {}).get("stot", before))
    await asyncio.sleep(steady_s)
    after = int(cluster.haproxy.stats()[spare.name]["stot"])
    notes = {
        "up_after_s": round(up_s, 2),
        "new_replica_requests_before_up": at_up - before,
        "new_replica_requests_after_up": after - at_up,
    }
    return load.since("scale", mark, notes)


async def config_change(cluster: Cluster, load: SteadyLoad, steady_s: float) -> EventResult:
    # "instances" replaces the model's runtime: a new one is loaded and warmed
    # beside the old, routing swaps, the old one drains and unloads.
    raw = json.dumps(replica_config(instances=2)).encode()
    import hashlib

    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    mark = load.mark()
    t0 = time.monotonic()
    for r in cluster.active:
        configmap_write(r.mount, {"config.json": raw})

    def applied_everywhere() -> float:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while any(r.config_hash() != digest for r in cluster.active):
            if time.monotonic() > deadline:
                raise TimeoutError("the config change was not applied by every replica")
            time.sleep(0.05)
        return time.monotonic() - t0

    applied_s = await _off_loop(applied_everywhere)
    await asyncio.sleep(steady_s)
    return load.since("config", mark, {"applied_everywhere_after_s": round(applied_s, 2)})


async def kill(cluster: Cluster, load: SteadyLoad, steady_s: float) -> EventResult:
    victim = cluster.active[-1]
    mark = load.mark()
    victim.signal(signal.SIGKILL)
    down_s = await _off_loop(cluster.haproxy.wait_status, victim.name, "DOWN")
    # The requests sent before DOWN was seen may still be on their way back (on a
    # slow machine, a 503 HAProxy sent just before): count them as before DOWN.
    await load.settle()
    failed_until_down = load.window.errors - mark[2]
    refused = load.window.statuses.get(503, 0) - mark[3].get(503, 0)
    await _off_loop(victim.wait_exit)
    victim.start()
    up_s = await _off_loop(cluster.haproxy.wait_status, victim.name, "UP")
    await asyncio.sleep(steady_s)
    notes = {
        "down_after_s": round(down_s, 2),
        "failed_until_down": failed_until_down,
        # Requests sent to it until HAProxy saw it DOWN (connect refused:
        # HAProxy's 503), and the rest: 502s and lost connections (in flight
        # on the victim; the load generator does not tell them apart further).
        "other_failed": failed_until_down - refused,
        "refused_until_down": refused,
        "restarted_up_after_s": round(up_s, 2),
    }
    return load.since("kill", mark, notes)


RUNNERS = {"rolling": rolling, "scale": scale, "config": config_change, "kill": kill}


async def run_scenarios(
    root: Path, replicas: int, concurrency: int, steady_s: float, scenarios: list[str]
) -> list[EventResult]:
    """Start the cluster, put the load on, run ``scenarios`` in order, stop everything."""
    cluster = Cluster(root, replicas, spare=1 if "scale" in scenarios else 0)
    results: list[EventResult] = []
    try:
        await _off_loop(cluster.start)
        load = SteadyLoad(cluster.haproxy.url, concurrency)
        await load.start()
        try:
            mark = load.mark()
            await asyncio.sleep(steady_s)
            results.append(load.since("steady", mark, {}))
            for name in scenarios:
                results.append(await RUNNERS[name](cluster, load, steady_s))
        finally:
            await load.stop()
    finally:
        cluster.stop()
    return results


def markdown(results: list[EventResult]) -> str:
    lines = [
        "| scenario | seconds | requests | failed | p99 ms | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items())
        if r.statuses:
            notes = f"statuses {r.statuses}; {notes}"
        lines.append(
            f"| {r.scenario} | {r.seconds} | {r.requests} | {r.failed} | {r.p99_ms} | {notes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steady-s", type=float, default=2.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="aserve-cluster-") as tmp:
        results = asyncio.run(
            run_scenarios(Path(tmp), args.replicas, args.concurrency, args.steady_s, scenarios)
        )
    print(markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps([r.as_dict() for r in results], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
