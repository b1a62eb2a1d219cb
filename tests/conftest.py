"""Fixtures: test models on disk and real aserve servers on loopback.

Servers run as subprocesses (``python -m aserve --config ...``) on free
ports; readiness is polled from the log lines and ``/v2/health/ready``, never
guessed with sleeps. A config with a ``grpc`` section gets gRPC on a free
port too (``"port": 0``), learnt from its log line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from models import build_all

START_TIMEOUT_S = 60
HANDLERS = Path(__file__).parent / "handlers"  # handler modules tests copy beside a config


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    port: int
    grpc_port: int | None = None
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_url(self) -> str:
        assert self.grpc_port is not None, "this server has no gRPC frontend"
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawned_children(self) -> list[Any]:
        """The server's step and worker processes (multiprocessing's spawned children),
        as psutil processes; one that has exited (a zombie not reaped yet) is not among them."""
        import psutil

        found = []
        for p in psutil.Process(self.proc.pid).children():
            try:
                cmdline = " ".join(p.cmdline())
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
            if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
                found.append(p)
        return found

    def log_text(self) -> str:
        return "".join(self.log)

    def worker_pid(self, model: str, index: int = 0) -> int:
        """The pid of worker ``index`` of a model served with ``"executor": "process"``,
        from the newest line the pool logged when that worker came up."""
        want = f"worker process {index} of '{model}' is up (pid "
        for line in reversed(self.log):
            if want in line:
                # "(pid N)", or "(pid N, started early)"
                return int(line.split(want, 1)[1].split(")", 1)[0].split(",", 1)[0])
        raise AssertionError(f"no worker {index} of {model!r} in the log")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def spec(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


def model_entry(name: str, path: str, inputs: list, outputs: list, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "torch",
        "path": path,
        "inputs": inputs,
        "outputs": outputs,
        **extra,
    }


def write_config(folder: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    """Write ``config`` as JSON; with ``drain_grace_s`` 0 unless it says otherwise,
    so that stopping a test server does not wait out the default grace period."""
    path = folder / name
    path.write_text(json.dumps({"drain_grace_s": 0, **config}, indent=2))
    return path


def start_server(
    config_path: Path | None,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    argv: list[str] | None = None,
    ready: bool = True,
) -> ServerProcess:
    """Start ``python -m aserve --config`` on a free port; wait until it is ready
    (with ``ready`` False, only until it listens: its models may still load).

    With ``argv`` (and no config), ``python -m aserve *argv`` instead: it names the
    port (``--port 0``) and gRPC (``--grpc-port 0`` or ``--no-grpc``) itself."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if argv is None:
        assert config_path is not None
        argv = ["--config", str(config_path), "--port", "0", *extra_args]
        wants_grpc = "grpc" in json.loads(config_path.read_text())
    else:
        wants_grpc = "--no-grpc" not in argv
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    server = ServerProcess(proc, 0)
    port_found = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            server.log.append(line)
            m = re.search(r"gRPC \(KServe V2\) listening on \S+:(\d+)", line)
            if m and server.grpc_port is None:
                server.grpc_port = int(m.group(1))
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m and not server.port:
                server.port = int(m.group(1))
            # gRPC starts after HTTP: both are known once its line is seen.
            if server.port and (server.grpc_port or not wants_grpc):
                port_found.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not port_found.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start:\n{server.log_text()}")
    if not ready:
        return server
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.base + "/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server never became ready:\n{server.log_text()}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    build_all(folder)
    return folder


@pytest.fixture(scope="session")
def eager_models(model_dir: Path) -> dict[str, Any]:
    """The served models, loaded back from their files in this process."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "affine": torch.jit.load(str(model_dir / "affine.pt")),
            "pair": torch.export.load(str(model_dir / "pair.pt2")).module(),
            "mixed": torch.jit.load(str(model_dir / "mixed.pt")),
        }


def standard_models() -> list[dict[str, Any]]:
    mixed_io = [
        ("FLAGS", "BOOL"), ("SMALL", "INT8"), ("BIG", "INT64"),
        ("HALF", "FP16"), ("DOUBLE", "FP64"), ("OCTETS", "UINT8"),
    ]  # fmt: skip
    return [
        model_entry(
            "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
            batching={"max_batch_size": 32, "max_delay_ms": 2.0, "preferred_batch_sizes": [8, 16, 32]},
        ),
        model_entry(
            "pair", "pair.pt2", [spec("A", "FP32", [8]), spec("B", "FP32", [8])],
            [spec("SUM", "FP32", [8]), spec("DOT", "FP32", [1])],
        ),
        model_entry(
            "mixed", "mixed.pt", [spec(f"IN_{n}", t, [3]) for n, t in mixed_io],
            [spec(f"OUT_{n}", t, [3]) for n, t in mixed_io],
        ),
        # In a worker process, so that tests can hold its batches running (helpers.frozen).
        model_entry(
            "spin", "spin.pt", [spec("X", "FP32", [-1])], [spec("Y", "FP32", [1])],
            batching={"max_batch_size": 4, "max_queue_size": 2, "max_delay_ms": 0},
            executor="process",
        ),
        {
            "name": "sleepy", "engine": "python", "handler": "sleeper:Sleeper",
            "parameters": {"sleep_ms": 1000},
            "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
            "batching": {"max_batch_size": 2},
        },
        model_entry("fussy", "fussy.pt", [spec("X", "FP32", [2])], [spec("Y", "FP32", [2])]),
    ]  # fmt: skip


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    """One shared server with every standard test model."""
    config = {
        "limits": {"max_request_bytes": 2 * 1024 * 1024},
        "grpc": {"port": 0},
        "models": standard_models(),
    }
    shutil.copy(HANDLERS / "sleeper.py", model_dir / "sleeper.py")
    srv = start_server(write_config(model_dir, config))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def grpc_client(server: ServerProcess) -> Iterator[Any]:
    """A tritonclient.grpc client of the shared server."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def decoder_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny LMs the decoder server serves (see tests/gen_helpers.py)."""
    from gen_helpers import build_decoder_models

    root = tmp_path_factory.mktemp("decoder")
    return build_decoder_models(root, tmp_path_factory.getbasetemp() / "lms")


@pytest.fixture(scope="session")
def decoder_server(
    decoder_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server with the decoder models (gpt2, llama, gpt2-eos), HTTP and gRPC."""
    folder = tmp_path_factory.mktemp("decoder-server")
    config = {"grpc": {"port": 0}, "models": decoder_models["models"]}
    srv = start_server(write_config(folder, config))
    yield srv
    srv.stop()


def affine_and_spin(model_dir: Path) -> list[dict[str, Any]]:
    """Two models for limit tests: ``affine`` (a quick one) and ``spin``, in a worker
    process that ``helpers.frozen`` can hold, so a test keeps a batch running."""
    return [
        model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                    [spec("OUTPUT0", "FP32", [16])]),
        model_entry("spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])],
                    [spec("Y", "FP32", [1])], executor="process",
                    batching={"max_batch_size": 4, "max_delay_ms": 0, "timeout_ms": 60000}),
    ]  # fmt: skip
