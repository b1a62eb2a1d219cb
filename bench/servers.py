"""Starting, probing and stopping the servers under test, one process each.

A server is ready when it has logged ``listening on http://HOST:PORT`` and
answers 200 on ``/v2/health/ready``; readiness is polled, never guessed.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

_LISTENING = re.compile(r"listening on http://([0-9.]+):(\d+)")

# Fair settings for every process that runs a model (shared/PEERS.md).
MODEL_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class ServerError(RuntimeError):
    """A server failed to start; the message carries the tail of its log."""


class ServerProcess:
    """A running server; use as a context manager so it always stops."""

    def __init__(self, label: str, argv: list[str], cwd: Path, start_timeout_s: float = 180.0):
        self.label = label
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **MODEL_ENV}
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self.port = self._wait_listening(start_timeout_s)
        # Keep draining stderr so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(start_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_listening(self, timeout_s: float) -> int:
        assert self.proc.stderr is not None
        # A reader thread, so a server that hangs silently cannot block us past the timeout.
        found: list[int] = []
        done = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = _LISTENING.search(line)
                if m:
                    found.append(int(m.group(2)))
                    break
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout_s) or not found:
            self.stop()
            raise ServerError(f"{self.label} did not start listening:\n{self.log_tail()}")
        return found[0]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.base_url + "/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"{self.label} never became ready:\n{self.log_tail()}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def log_tail(self, lines: int = 30) -> str:
        return "".join(list(self.log)[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # both servers drain and stop on SIGTERM
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_aserve(config: Path, cwd: Path) -> ServerProcess:
    argv = [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"]
    return ServerProcess("aserve", argv, cwd)


def start_plain(model_file: Path, name: str, cwd: Path) -> ServerProcess:
    argv = [
        sys.executable, "-m", "bench.baseline_aiohttp",
        "--model", str(model_file), "--name", name, "--port", "0",
    ]  # fmt: skip
    return ServerProcess("plain aiohttp", argv, cwd)


def aserve_config(
    name: str, model_path: str, features: int, cpu_threads: int = 1
) -> dict[str, Any]:
    """An aserve config serving one FP32 [features] -> [features] model, batching as issue 2 sets."""
    return {
        "http": {"host": "127.0.0.1", "port": 0},
        "models": [
            {
                "name": name,
                "engine": "torch",
                "path": model_path,
                "device": "cpu",
                "instances": 1,
                "cpu_threads": cpu_threads,
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [features]}],
                "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [features]}],
                "batching": {
                    "max_batch_size": 32,
                    "max_delay_ms": 2.0,
                    "preferred_batch_sizes": [8, 16, 32],
                    "max_queue_size": 1024,
                    "timeout_ms": 5000,
                },
            }
        ],
    }
