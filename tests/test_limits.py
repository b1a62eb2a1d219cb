"""limits.max_connections, max_concurrency and max_tensor_elements: immediate refusals."""

from __future__ import annotations

import http.client
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from conftest import ServerProcess, affine_and_spin, start_server, write_config
from helpers import frozen, grpc_input, sync_stats, sync_wait_for_stats

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)

MAX_ELEMENTS = 70_000


def _server(model_dir: Path, folder: Path, limits: dict[str, int]) -> ServerProcess:
    config = {"limits": limits, "grpc": {"port": 0}, "models": affine_and_spin(model_dir)}
    return start_server(write_config(folder, config))


def post(base: str, path: str, doc: dict[str, Any], timeout: float = 30) -> tuple[int, dict, Any]:
    req = urllib.request.Request(base + path, data=orjson.dumps(doc), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), orjson.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), orjson.loads(exc.read())


def affine_body(rows: int) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32",
                        "data": [1.0] * (16 * rows)}]}  # fmt: skip


def spin_body(columns: int) -> dict[str, Any]:
    return {"inputs": [{"name": "X", "shape": [1, columns], "datatype": "FP32",
                        "data": [0.0] * columns}]}  # fmt: skip


@pytest.fixture(scope="module")
def limited(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("limits")
    limits = {"max_concurrency": 2, "max_tensor_elements": MAX_ELEMENTS}
    srv = _server(model_dir, folder, limits)
    yield srv
    srv.stop()


def test_max_tensor_elements(limited: ServerProcess) -> None:
    assert post(limited.base, "/v2/models/spin/infer", spin_body(4))[0] == 200
    status, _, doc = post(limited.base, "/v2/models/spin/infer", spin_body(MAX_ELEMENTS + 1))
    assert status == 413
    assert doc["error"] == (
        "input 'X' has 70001 elements (shape [1, 70001]), over the limit "
        "limits.max_tensor_elements 70000"
    )
    client = grpcclient.InferenceServerClient(limited.grpc_url)
    try:
        x = np.zeros((1, MAX_ELEMENTS + 1), np.float32)
        with pytest.raises(grpcclient.InferenceServerException) as refused:
            client.infer("spin", [grpc_input("X", x)])
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert refused.value.message() == doc["error"]
    finally:
        client.close()


def test_max_concurrency_counts_both_frontends(limited: ServerProcess) -> None:
    base = limited.base
    held: list[int] = []

    def send_held(columns: int) -> None:
        held.append(post(base, "/v2/models/spin/infer", spin_body(columns), timeout=60)[0])

    # Two requests held by the frozen worker (different shapes: never one batch) fill
    # the limit of 2.
    with frozen(limited.worker_pid("spin")):
        threads = [threading.Thread(target=send_held, args=(2 + i,)) for i in range(2)]
        for t in threads:
            t.start()
        sync_wait_for_stats(
            base, "spin", lambda s: s["pending_request_count"] + s["running_batch_count"] == 2
        )
        _refused_over_http_and_grpc(limited)
    for t in threads:
        t.join(60)
    assert held == [200, 200]
    # Room again: refusals left nothing behind.
    assert post(base, "/v2/models/affine/infer", affine_body(1))[0] == 200


def _refused_over_http_and_grpc(limited: ServerProcess) -> None:
    """Both frontends refuse an inference at once while the limit is reached."""
    base = limited.base
    status, headers, doc = post(base, "/v2/models/affine/infer", affine_body(1))
    assert status == 429 and headers["Retry-After"] == "1"
    assert doc["error"] == (
        "server is serving 2 requests, its limit limits.max_concurrency is 2; retry later"
    )
    with grpc.insecure_channel(limited.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="affine")
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_concurrency is 2" in (refused.value.details() or "")
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert (
        'aserve_rejected_requests_total{model="",reason="max_concurrency",version=""} 2.0' in text
    )


@pytest.fixture(scope="module")
def few_connections(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("connections")
    srv = _server(model_dir, folder, {"max_connections": 2})
    yield srv
    srv.stop()


def _infer_on(conn: http.client.HTTPConnection) -> tuple[int, dict[str, str], Any]:
    conn.request("POST", "/v2/models/affine/infer", orjson.dumps(affine_body(1)))
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), orjson.loads(r.read())


def test_max_connections_http(few_connections: ServerProcess) -> None:
    port = few_connections.port
    first, second = (http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(2))
    assert _infer_on(first)[0] == 200  # keep-alive: both stay open
    assert _infer_on(second)[0] == 200
    third = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, headers, doc = _infer_on(third)
    assert status == 429 and headers["Retry-After"] == "1"
    assert headers["Connection"] == "close"
    assert doc["error"] == (
        "server has 2 HTTP connections serving requests, its limit limits.max_connections "
        "is 2; retry later"
    )
    third.close()
    # Any route: a raw body to /predictions, the model config, on one connection too many.
    for method, path, body, headers in (
        ("POST", "/predictions/affine", b"\xff\xd8", {"Content-Type": "image/jpeg"}),
        ("GET", "/v2/models/affine/config", None, {}),
    ):
        fourth = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        fourth.request(method, path, body, headers)
        r = fourth.getresponse()
        assert r.status == 429, path
        assert "limits.max_connections is 2" in orjson.loads(r.read())["error"]
        fourth.close()
    assert _infer_on(first)[0] == 200  # the open ones are served as before
    second.close()
    # Once the server has seen a connection go, a new one is served.
    deadline = time.monotonic() + 10
    while True:
        fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status = _infer_on(fresh)[0]
        fresh.close()
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200
    first.close()


def test_max_connections_grpc_calls(few_connections: ServerProcess) -> None:
    """Two open streams are two calls in flight; a third call is refused at once."""
    clients = [grpcclient.InferenceServerClient(few_connections.grpc_url) for _ in range(3)]
    try:
        answered: queue.Queue = queue.Queue()
        x = np.ones((1, 16), np.float32)
        for c in clients[:2]:
            c.start_stream(callback=lambda result, error: answered.put(error))
            # An answer on the stream: the server has the call, however slow the machine.
            c.async_stream_infer("affine", [grpc_input("INPUT0", x)])
        assert [answered.get(timeout=30) for _ in range(2)] == [None, None]
        deadline = time.monotonic() + 10
        while True:  # the streams are open once the server counts them
            try:
                clients[2].infer("affine", [grpc_input("INPUT0", x)])
            except grpcclient.InferenceServerException as exc:
                refused = exc
                break
            assert time.monotonic() < deadline, "the third call was never refused"
            time.sleep(0.05)
        assert refused.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert refused.message() == (
            "server has 2 gRPC inference calls in flight, its limit limits.max_connections "
            "is 2; retry later"
        )
        clients[0].stop_stream()
        deadline = time.monotonic() + 10
        while True:
            try:
                clients[2].infer("affine", [grpc_input("INPUT0", x)])
                break
            except grpcclient.InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert sync_stats(few_connections.base, "affine")["inference_count"] >= 1
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("key", ["max_connections", "max_concurrency", "max_tensor_elements"])
def test_limits_config(key: str) -> None:
    from aserve.config import ConfigError, parse_config

    model = affine_and_spin(Path("."))[0]
    assert getattr(parse_config({"models": [model]}).limits, key) is None  # off by default
    assert getattr(parse_config({"limits": {key: 5}, "models": [model]}).limits, key) == 5
    with pytest.raises(ConfigError, match=rf"limits\.{key}: must be >= 1"):
        parse_config({"limits": {key: 0}, "models": [model]})
