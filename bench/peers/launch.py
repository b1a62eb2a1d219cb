"""Starting, probing and stopping each server under test, one process tree at a time.

Every server gets a free loopback port, its own log file, the fair settings
of shared/PEERS.md in its environment, and its own process group, so that
stopping it ends every process it started. Cold start is the time from
``Popen`` to the first 200 answer to the benchmark's own request; peak RSS
is sampled over the whole process tree while it lives.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.loadgen import ProtocolError, fetch_once
from bench.servers import MODEL_ENV

REPO = Path(__file__).resolve().parents[2]
APPS = Path(__file__).resolve().parent / "apps"


class StartError(RuntimeError):
    """A server did not come up; the message carries why and its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Plan:
    """How to start one server for one workload."""

    label: str
    argv: list[str]
    url: str  # where the benchmark's request goes
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    stats_url: str | None = None  # aserve's per-model statistics (Triton's format)
    headers: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 240.0
    notes: list[str] = field(default_factory=list)
    cwd: Path = REPO  # where it starts (for aserve: which tree's code runs)


class Running:
    """A started server: its process group, log, peak RSS and cold start."""

    def __init__(
        self,
        plan: Plan,
        body: bytes,
        log_path: Path,
        first: Callable[[], Awaitable[tuple[int, bytes]]] | None = None,
    ) -> None:
        """Start ``plan``; ready at the first 200 to ``body`` (or to ``first()``, e.g. a stream)."""
        self.plan = plan
        self._first = first
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **MODEL_ENV, **plan.env}
        self._log = log_path.open("w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            plan.argv, cwd=plan.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.peak_rss = 0
        self._pids: set[int] = {self.proc.pid}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        try:
            self.cold_start_s = self._wait_first_answer(body)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            total = 0
            for p in self._tree():
                try:
                    total += p.memory_info().rss
                    self._pids.add(p.pid)
                except psutil.Error:
                    continue
            self.peak_rss = max(self.peak_rss, total)

    def _wait_first_answer(self, body: bytes) -> float:
        deadline = self.t0 + self.plan.start_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"exited with {self.proc.returncode} before answering:\n"
                                 f"{self.log_tail()}")  # fmt: skip
            try:
                if self._first is not None:
                    status, reply = asyncio.run(self._first())
                else:
                    status, reply = asyncio.run(
                        fetch_once(self.plan.url, body, timeout_s=10, headers=self.plan.headers)
                    )
            except (OSError, asyncio.TimeoutError, ValueError, ProtocolError) as exc:
                last = repr(exc)
            else:
                if status == 200:
                    self.first_reply = reply
                    return time.monotonic() - self.t0
                last = f"status {status}: {reply[:300]!r}"
            time.sleep(0.2)
        self.stop()
        raise StartError(
            f"no 200 answer within {self.plan.start_timeout_s:.0f} s (last: {last}):\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, chars: int = 2500) -> str:
        try:
            if not self._log.closed:
                self._log.flush()
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._log.closed:
            return  # stopped already
        self._stop.set()
        known = {pid for pid in self._pids} | {p.pid for p in self._tree()}
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever of its tree is left (daemons, workers in other groups) is killed.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in known:
            try:
                p = psutil.Process(pid)
                if p.is_running():
                    p.kill()
            except psutil.Error:
                continue
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the servers ---------------------------------------------------------------------------


@dataclass
class Context:
    """What a plan needs: where things are, and the fair settings."""

    cache: Path
    scratch: Path
    minilm_dir: Path
    venv_python: dict[str, Path]  # peer -> its venv's python
    torch_threads: int
    max_batch: int
    max_wait_ms: float
    tiny_model_file: Path  # TorchScript y = x + 1, for aserve's torch engine

    def base_env(self) -> dict[str, str]:
        return {
            "BENCH_MINILM_DIR": str(self.minilm_dir),
            "BENCH_TORCH_THREADS": str(self.torch_threads),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }


def _aserve(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    folder = ctx.scratch / f"aserve-{workload}"
    folder.mkdir(parents=True, exist_ok=True)
    batching = {
        "max_batch_size": ctx.max_batch,
        "max_delay_ms": 0.0 if variant == "nowait" else ctx.max_wait_ms,
        "max_queue_size": 1024,
        "timeout_ms": 5000,
    }
    if workload == "tiny":
        shutil.copy(ctx.tiny_model_file, folder / "tiny.pt")
        model = {
            "name": "tiny", "engine": "torch", "path": "tiny.pt", "device": "cpu",
            "instances": 1, "cpu_threads": ctx.torch_threads,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
            "batching": batching,
        }  # fmt: skip
    else:
        for name in ("common.py", "aserve_minilm.py"):
            shutil.copy(APPS / name, folder / name)
        model = {
            "name": "minilm", "engine": "python", "handler": "aserve_minilm:MiniLMHandler",
            "parameters": {"model_dir": str(ctx.minilm_dir)}, "instances": 1,
            # aserve sets the handler's torch threads after its load, as the peers' own.
            "cpu_threads": ctx.torch_threads,
            # The model in a worker process: it never waits for the loop's GIL.
            "executor": "thread" if variant == "thread" else "process",
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [384]}],
            "batching": batching,
            # Also served on OpenAI's /v1/embeddings (the bench itself sends V2 /infer).
            "openai": {"embeddings": {"input": "TEXT", "output": "EMBEDDING"}},
        }  # fmt: skip
    config = {"http": {"host": "127.0.0.1", "port": port}, "models": [model]}
    cfg = folder / "aserve.json"
    cfg.write_text(json.dumps(config, indent=2))
    argv = [sys.executable, "-m", "aserve", "--config", str(cfg), "--port", str(port),
            "--log-level", "WARNING"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Plan(
        "aserve", argv, f"{base}/v2/models/{workload}/infer", ctx.base_env(),
        health_url=f"{base}/v2/health/ready", stats_url=f"{base}/v2/models/{workload}/stats",
    )  # fmt: skip


def _plain(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    argv = [sys.executable, str(APPS / "plain_app.py"), "--workload", workload,
            "--port", str(port)]  # fmt: skip
    return Plan("plain", argv, f"http://127.0.0.1:{port}/infer", ctx.base_env())


def _batch_args(ctx: Context, variant: str) -> list[str]:
    wait = 0.0 if variant == "nowait" else ctx.max_wait_ms
    return ["--max-batch", str(ctx.max_batch), "--max-wait-ms", str(wait)]


def _litserve(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    argv = [str(ctx.venv_python["litserve"]), str(APPS / "litserve_app.py"),
            "--workload", workload, "--port", str(port), *_batch_args(ctx, variant)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Plan("litserve", argv, f"{base}/infer", ctx.base_env(), health_url=f"{base}/health")


def _ray(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    home = ctx.scratch / "ray-home"
    home.mkdir(parents=True, exist_ok=True)
    argv = [str(ctx.venv_python["ray"]), str(APPS / "ray_app.py"), "--workload", workload,
            "--port", str(port), *_batch_args(ctx, variant)]  # fmt: skip
    env = {**ctx.base_env(), "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_DEDUP_LOGS": "0"}  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Plan("ray", argv, f"{base}/infer", env, health_url=f"{base}/-/healthz")


LOG4J = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders><Console name="STDOUT" target="SYSTEM_OUT">
    <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/></Console></Appenders>
  <Loggers><Root level="warn"><AppenderRef ref="STDOUT"/></Root></Loggers>
</Configuration>
"""


def _torchserve(ctx: Context, workload: str, variant: str) -> Plan:
    port, mgmt, metrics = free_port(), free_port(), free_port()
    folder = ctx.scratch / f"torchserve-{workload}-{variant}"
    store = folder / "store"
    store.mkdir(parents=True, exist_ok=True)
    bindir = ctx.venv_python["torchserve"].parent
    setup = folder / "setup.json"
    setup.write_text(json.dumps({"workload": workload, "env": ctx.base_env()}))
    mar = store / f"{workload}.mar"
    if not mar.is_file():
        subprocess.run(
            [str(bindir / "torch-model-archiver"), "--model-name", workload, "--version", "1.0",
             "--handler", str(APPS / "torchserve_handler.py"),
             "--extra-files", f"{APPS / 'common.py'},{setup}",
             "--export-path", str(store), "--force"],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    delay = 0 if variant == "nowait" else round(ctx.max_wait_ms)
    models = {workload: {"1.0": {
        "defaultVersion": True, "marName": f"{workload}.mar", "minWorkers": 1,
        "maxWorkers": 1, "batchSize": ctx.max_batch, "maxBatchDelay": delay,
        "responseTimeout": 120}}}  # fmt: skip
    props = folder / "config.properties"
    props.write_text("\n".join([
        f"inference_address=http://127.0.0.1:{port}",
        f"management_address=http://127.0.0.1:{mgmt}",
        f"metrics_address=http://127.0.0.1:{metrics}",
        "disable_token_authorization=true", "enable_model_api=false",
        f"model_store={store}", f"load_models={workload}.mar",
        f"models={json.dumps(models)}", "default_workers_per_model=1",
        "job_queue_size=1024", "disable_system_metrics=true",
        "install_py_dep_per_model=false", "async_logging=true",
        "vmargs=-Xmx1g -XX:+UseContainerSupport -XX:ActiveProcessorCount=2",
    ]) + "\n")  # fmt: skip
    log4j = folder / "log4j2.xml"
    log4j.write_text(LOG4J)
    argv = [str(bindir / "torchserve"), "--start", "--foreground", "--ncs",
            "--model-store", str(store), "--ts-config", str(props),
            "--disable-token-auth", "--log-config", str(log4j)]  # fmt: skip
    env = {**ctx.base_env(), "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
           "LOG_LOCATION": str(folder / "logs"), "METRICS_LOCATION": str(folder / "logs"),
           "TS_CONFIG_FILE": str(props)}  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Plan("torchserve", argv, f"{base}/predictions/{workload}", env,
                health_url=f"{base}/ping")  # fmt: skip


def _pytriton(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    py = ctx.venv_python["pytriton"]
    libdir = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True, text=True, timeout=60,
    ).stdout.strip() or sysconfig.get_config_var("LIBDIR")  # fmt: skip
    home = ctx.scratch / "pytriton-home"
    home.mkdir(parents=True, exist_ok=True)
    argv = [str(py), str(APPS / "pytriton_app.py"), "--workload", workload,
            "--port", str(port), "--grpc-port", str(free_port()),
            "--metrics-port", str(free_port()), *_batch_args(ctx, variant)]  # fmt: skip
    env = {**ctx.base_env(), "HOME": str(home),
           # Its Python backend stub must load this interpreter's libpython (PEERS.md).
           "LD_LIBRARY_PATH": ":".join(x for x in (libdir, os.environ.get("LD_LIBRARY_PATH"))
                                       if x)}  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Plan("pytriton", argv, f"{base}/v2/models/{workload}/infer", env,
                health_url=f"{base}/v2/health/ready")  # fmt: skip


def _mlserver(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    folder = ctx.scratch / f"mlserver-{workload}"
    model_dir = folder / workload
    model_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "host": "127.0.0.1", "http_port": port, "grpc_port": free_port(),
        "metrics_port": free_port(),
        "debug": False,  # its default, true, logs every request (uvicorn's access log)
        "parallel_workers": 1,  # the model in one worker process (MLServer's default)
        "metrics_dir": str(folder / "metrics"), "environments_dir": str(folder / "envs"),
    }  # fmt: skip
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    model = {
        "name": workload, "implementation": "mlserver_app.BenchModel",
        "max_batch_size": ctx.max_batch, "max_batch_time": ctx.max_wait_ms / 1e3,
        "parameters": {"extra": {"workload": workload}},
    }  # fmt: skip
    (model_dir / "model-settings.json").write_text(json.dumps(model, indent=2))
    bindir = ctx.venv_python["mlserver"].parent
    argv = [str(bindir / "mlserver"), "start", str(folder)]
    env = {**ctx.base_env(), "PYTHONPATH": str(APPS)}
    base = f"http://127.0.0.1:{port}"
    return Plan("mlserver", argv, f"{base}/v2/models/{workload}/infer", env,
                health_url=f"{base}/v2/health/ready")  # fmt: skip


def _mosec(ctx: Context, workload: str, variant: str) -> Plan:
    port = free_port()
    argv = [str(ctx.venv_python["mosec"]), str(APPS / "mosec_app.py"), "--workload", workload,
            "--port", str(port), *_batch_args(ctx, variant), "--address", "127.0.0.1",
            "--log-level", "warning"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    # Its IPC sockets go to the scratch folder (a random name under the system's tmp else).
    env = {**ctx.base_env(), "TMPDIR": str(ctx.scratch)}
    return Plan("mosec", argv, f"{base}/inference", env, health_url=f"{base}/")


# name -> (venv needed, plan builder, variant)
SERVERS: dict[str, tuple[str | None, Callable[[Context, str, str], Plan], str]] = {
    "aserve": (None, _aserve, "default"),
    "plain": (None, _plain, "default"),
    "litserve": ("litserve", _litserve, "default"),
    "ray": ("ray", _ray, "default"),
    "torchserve": ("torchserve", _torchserve, "default"),
    "pytriton": ("pytriton", _pytriton, "default"),
    "mlserver": ("mlserver", _mlserver, "default"),
    "mosec": ("mosec", _mosec, "default"),
    # The no-wait variants: on this CPU the stronger opponent at low and middle load.
    "pytriton-nowait": ("pytriton", _pytriton, "nowait"),
    "litserve-nowait": ("litserve", _litserve, "nowait"),
    "ray-nowait": ("ray", _ray, "nowait"),
    "torchserve-nowait": ("torchserve", _torchserve, "nowait"),
    "aserve-nowait": (None, _aserve, "nowait"),
    "aserve-thread": (None, _aserve, "thread"),  # MiniLM's infer on a thread, not a process
}


def plan_for(name: str, ctx: Context, workload: str) -> Plan:
    _, build, variant = SERVERS[name]
    plan = build(ctx, workload, variant)
    plan.label = name
    return plan


def describe(plan: Plan) -> dict[str, Any]:
    return {"argv": [Path(a).name if "/" in a else a for a in plan.argv], "url_path":
            "/" + plan.url.split("/", 3)[3]}  # fmt: skip
