"""Starting up: the listeners are bound before any model loads.

A port in use fails at once (no model load begins); while models load, the
server is live and not ready, over HTTP and gRPC.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import HANDLERS, spec
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def _gated_config(folder: Path, gate: Path | None = None, **top: Any) -> Path:
    shutil.copy(HANDLERS / "gated.py", folder / "gated.py")
    parameters: dict[str, Any] = {"began": str(folder / "load-began")}
    if gate is not None:
        parameters["gate"] = str(gate)
    model = {
        "name": "gated", "engine": "python", "handler": "gated:Gated", "parameters": parameters,
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
    }  # fmt: skip
    path = folder / "config.json"
    path.write_text(json.dumps({**top, "models": [model]}))
    return path


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_port_in_use_fails_before_any_model_loads(tmp_path, which):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        grpc_port = port if which == "grpc" else 0
        path = _gated_config(tmp_path, grpc={"host": "127.0.0.1", "port": grpc_port})
        http_port = port if which == "http" else 0
        proc = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--config", str(path), "--port", str(http_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert proc.stderr is not None
        log = proc.stderr.read()  # ends when the process exits
        rc = proc.wait(30)
    assert rc == 1, log
    assert "cannot listen" in log and f"127.0.0.1:{port}" in log, log
    assert "Traceback" not in log, log
    assert not (tmp_path / "load-began").exists(), "a model load began:\n" + log
    assert "loaded" not in log, log
    # Refused by the preflight, before the server's imports (torch) and its start.
    assert " starting with " not in log, log


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_live_but_not_ready_while_models_load(tmp_path):
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    path = _gated_config(tmp_path, gate, grpc={"port": 0})
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--config", str(path), "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: list[str] = []
    ports: dict[str, int] = {}
    both = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "gRPC (KServe V2) listening on " in line:
                ports["grpc"] = int(line.rsplit(":", 1)[1])
            elif "listening on http://" in line:
                ports["http"] = int(line.rsplit(":", 1)[1])
            if len(ports) == 2:
                both.set()

    threading.Thread(target=pump, daemon=True).start()
    released = False
    try:
        assert both.wait(60), "".join(lines)
        # Listening and the model's load has begun (it waits on the gate): not ready.
        deadline = time.monotonic() + 60
        while not (tmp_path / "load-began").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.02)
        base = f"http://127.0.0.1:{ports['http']}"
        assert _get(f"{base}/v2/health/live") == (200, {"live": True})
        status, doc = _get(f"{base}/v2/health/ready")
        assert status == 503 and doc["error"] == "server is starting", doc
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        status, doc = _post(f"{base}/v2/models/gated/infer", body)
        assert status == 503 and "the server is starting" in doc["error"], doc
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Let the load finish: ready on both.
            with open(gate, "wb"):
                released = True
            while _get(f"{base}/v2/health/ready")[0] != 200:
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                time.sleep(0.02)
            answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        status, doc = _post(f"{base}/v2/models/gated/infer", body)
        assert status == 200 and doc["outputs"][0]["data"] == [3.0], doc
        # What startup made was frozen out of the collector's walks before ready.
        while not any("model(s) serving" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.02)
        order = [line for line in lines if "objects frozen" in line or "model(s) serving" in line]
        assert "objects frozen out of the collector's walks" in order[0], "".join(lines)
    finally:
        if not released:
            try:  # unblock the load so the server can stop
                os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        proc.terminate()
        assert proc.wait(30) == 0, "".join(lines)


def test_the_preflight_names_a_taken_address_and_passes_free_ones() -> None:
    from aserve.commands.preflight import address_in_use
    from aserve.config import parse_config

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        busy = parse_config({"http": {"host": "127.0.0.1", "port": port}, "models": []})
        assert address_in_use(busy) == (
            f"HTTP cannot listen on 127.0.0.1:{port}: Address already in use"
        )
        grpc_busy = parse_config(
            {"http": {"port": 0}, "grpc": {"host": "127.0.0.1", "port": port}, "models": []}
        )
        assert address_in_use(grpc_busy).startswith(f"gRPC cannot listen on 127.0.0.1:{port}")
    free = parse_config({"http": {"port": 0}, "grpc": {"port": 0}, "models": []})
    assert address_in_use(free) is None
