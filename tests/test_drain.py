"""SIGTERM under load loses nothing: every request the server read is answered.

Clients keep requests in flight on keep-alive HTTP connections and gRPC
channels while the server is told to stop. What a client may see is a
connection refused once the listeners are closed (it sent nothing); never a
reset, a closed connection with its request unanswered, or a gRPC call the
server ran and did not answer. The server's count of answered requests (its
``stopped`` log line) must equal the clients' count of answers received.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import psutil
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reload_helpers import wait_log

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

HTTP_CLIENTS = 64
GRPC_CHANNELS = 4
GRPC_CALLS_PER_CHANNEL = 4
X = np.arange(16, dtype=np.float32)
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": X.tolist()}]}


def _config(model_dir: Path, tmp_path: Path, **top: Any) -> Path:
    entry = model_entry(
        "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("OUTPUT0", "FP32", [16])],
        batching={"max_batch_size": 32, "max_delay_ms": 1.0},
    )  # fmt: skip
    return write_config(tmp_path, {"grpc": {"port": 0}, "models": [entry], **top})


def _infer_request() -> pb.ModelInferRequest:
    """One gRPC ModelInfer request of the affine model (a row of ``X``)."""
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 16])
    return pb.ModelInferRequest(
        model_name="affine", inputs=[tensor], raw_input_contents=[X.tobytes()]
    )


def _answered(server: ServerProcess) -> Counter[str]:
    """The server's own count of answered requests, from its ``stopped`` line."""
    m = re.search(r"stopped; requests answered: (.*)", server.log_text())
    assert m, server.log_text()[-3000:]
    counts: Counter[str] = Counter()
    for part in m.group(1).split(", "):
        protocol, status, n = part.split(" ")
        counts[f"{protocol} {status}"] = int(n)
    return counts


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)


async def _http_client(session: aiohttp.ClientSession, url: str, tally: Tally) -> None:
    """Requests one after another on a keep-alive connection until one is refused."""
    while True:
        try:
            async with session.post(url, json=BODY) as r:
                await r.read()
                if r.status != 200:
                    tally.fail(f"HTTP {r.status}")
                    return
                tally.counts["http ok"] += 1
        except aiohttp.ClientConnectorError as exc:  # connect() refused: nothing was sent
            if isinstance(exc.os_error, ConnectionRefusedError):
                tally.counts["http refused"] += 1
            else:
                tally.fail(f"connect: {exc!r}")
            return
        except (aiohttp.ClientError, OSError) as exc:  # reset, closed unanswered
            tally.fail(repr(exc))
            return


async def _grpc_client(stub: Any, tally: Tally) -> None:
    request = _infer_request()
    while True:
        try:
            await stub.ModelInfer(request, timeout=30)
            tally.counts["grpc ok"] += 1
        except grpc.aio.AioRpcError as exc:
            # The server is gone: a call the server took and did not answer
            # shows up as a count mismatch below, whatever the client saw.
            tally.counts[f"grpc {exc.code().name}"] += 1
            return


async def _load_until_stopped(server: ServerProcess) -> Tally:
    tally = Tally()
    url = f"{server.base}/v2/models/affine/infer"
    connector = aiohttp.TCPConnector(limit=HTTP_CLIENTS)
    async with aiohttp.ClientSession(connector=connector) as session:
        channels = [grpc.aio.insecure_channel(server.grpc_url) for _ in range(GRPC_CHANNELS)]
        tasks = [
            asyncio.create_task(_http_client(session, url, tally)) for _ in range(HTTP_CLIENTS)
        ]
        for channel in channels:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            tasks += [
                asyncio.create_task(_grpc_client(stub, tally))
                for _ in range(GRPC_CALLS_PER_CHANNEL)
            ]
        # Full speed on every connection before the signal.
        deadline = time.monotonic() + 60
        while tally.counts["http ok"] < 20 * HTTP_CLIENTS or tally.counts["grpc ok"] < 200:
            assert time.monotonic() < deadline, tally.counts
            assert not tally.failures, tally.failures
            await asyncio.sleep(0.02)
        at_signal = dict(tally.counts)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for channel in channels:
            await channel.close()
    tally.counts["after signal"] = tally.counts["http ok"] - at_signal["http ok"]
    return tally


def test_sigterm_under_keepalive_load_answers_every_request_read(model_dir, tmp_path):
    server = start_server(_config(model_dir, tmp_path))
    try:
        tally = asyncio.run(_load_until_stopped(server))
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    counts = tally.counts
    assert tally.failures == [], (tally.failures, counts)
    answered = _answered(server)
    # Every answer the server counted reached its client, and nothing else was counted.
    assert answered == Counter({"http ok": counts["http ok"], "grpc ok": counts["grpc ok"]}), (
        answered, counts,
    )  # fmt: skip
    # Each HTTP client ended on a refused connect (after an answer saying
    # Connection: close), none on an error.
    assert counts["http refused"] == HTTP_CLIENTS, counts
    # A gRPC call ends refused (UNAVAILABLE: the new connection is refused) or,
    # when grpc had received it but not handed it to aserve yet as the stop
    # began, cancelled by grpc itself (never run: the server counted it nowhere).
    grpc_ends = {k: n for k, n in counts.items() if k.startswith("grpc ") and k != "grpc ok"}
    assert set(grpc_ends) <= {"grpc UNAVAILABLE", "grpc CANCELLED"}, counts
    log = server.log_text()
    assert log.index("SIGTERM received: draining") < log.index("listeners closed")


def test_a_grpc_client_that_follows_health_loses_nothing_when_a_replica_drains(model_dir, tmp_path):
    """The one drain gap aserve cannot close (calls grpc received but had not handed
    to aserve when the stop began are cancelled by grpc) never opens for a client
    that follows health: with gRPC client-side health checking (round_robin plus
    ``healthCheckConfig`` in its service config) over two replicas, the drained one
    turns NOT_SERVING at SIGTERM, the client sends its calls to the other, and
    nothing is waiting in the drained one's grpc when its stop begins. Full speed
    throughout; the drained replica's grace (the server's own timer, 5 s, the
    default) is what the client has to read one health message."""
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    drained = start_server(_config(model_dir, folders[0], drain_grace_s=5.0))
    other = start_server(_config(model_dir, folders[1]))
    counts: Counter[str] = Counter()

    async def scenario() -> None:
        config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": ""},
        }
        channel = grpc.aio.insecure_channel(
            f"ipv4:{drained.grpc_url},{other.grpc_url}",
            options=[("grpc.service_config", json.dumps(config))],
        )
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = _infer_request()
        stop = asyncio.Event()
        goal, reached = [200], asyncio.Event()  # set once that many calls were answered

        async def caller() -> None:
            while not stop.is_set():
                try:
                    await stub.ModelInfer(request, timeout=30)
                    counts["ok"] += 1
                    if counts["ok"] >= goal[0]:
                        reached.set()
                except grpc.aio.AioRpcError as exc:
                    counts[exc.code().name] += 1

        tasks = [asyncio.create_task(caller()) for _ in range(4 * GRPC_CALLS_PER_CHANNEL)]
        await asyncio.wait_for(reached.wait(), 60)  # full speed, on both replicas
        drained.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(drained.proc.wait, 60) == 0
        goal[0] = counts["ok"] + 100  # and on after its stop, on the other replica
        reached.clear()
        await asyncio.wait_for(reached.wait(), 60)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await channel.close()

    try:
        asyncio.run(scenario())
        other.proc.send_signal(signal.SIGTERM)
        assert other.proc.wait(60) == 0
    finally:
        for server in (drained, other):
            if server.proc.poll() is None:
                server.proc.kill()
    assert set(counts) == {"ok"}, counts  # no call failed, none was cancelled
    served = [_answered(server)["grpc ok"] for server in (drained, other)]
    assert served[0] > 0 and sum(served) == counts["ok"], (served, counts)


def test_connections_queued_in_the_backlog_at_sigterm_are_answered(model_dir, tmp_path):
    """Connections the kernel accepted while the server could not (it is stopped
    here) have sent their request: closing the listener would reset them."""
    server = start_server(_config(model_dir, tmp_path))
    raw = (
        f"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(_json_body())}\r\n\r\n"
    ).encode() + _json_body()
    socks: list[socket.socket] = []
    try:
        proc = psutil.Process(server.proc.pid)
        proc.suspend()
        for _ in range(16):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(raw)
            socks.append(s)
        server.proc.send_signal(signal.SIGTERM)
        proc.resume()
        for s in socks:
            head = _read_response(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            # Then the server closes it: at once after an answer that says
            # Connection: close, or as an idle connection while it drains (the loop
            # may have answered a request or two before it ran the signal's handler).
            assert s.recv(1) == b"", "the server left a drained connection open"
        assert server.proc.wait(60) == 0
    finally:
        for s in socks:
            s.close()
        if server.proc.poll() is None:
            server.proc.kill()
    assert _answered(server) == Counter({"http ok": len(socks)})


def _json_body() -> bytes:
    import orjson

    return orjson.dumps(BODY)


def _read_response(s: socket.socket) -> bytes:
    """A whole response (head and Content-Length body); the head is returned."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return head


def test_grace_period_is_not_ready_but_serving(model_dir, tmp_path):
    grace_s = 4.0
    server = start_server(_config(model_dir, tmp_path, drain_grace_s=grace_s))

    async def scenario() -> None:
        url = f"{server.base}/v2/models/affine/infer"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=BODY) as r:  # a keep-alive connection
                assert r.status == 200
            channel = grpc.aio.insecure_channel(server.grpc_url)
            health = health_pb2_grpc.HealthStub(channel)
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_log, server, "serving on for drain_grace_s")
            async with session.get(f"{server.base}/v2/health/ready") as r:
                assert r.status == 503, await r.text()
                assert (await r.json())["error"] == "server is draining"
            check = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Inference goes on, on the open connection and on new ones, HTTP and gRPC.
            async with session.post(url, json=BODY) as r:
                assert r.status == 200 and r.headers.get("Connection") != "close"
            async with aiohttp.ClientSession() as fresh, fresh.post(url, json=BODY) as r:
                assert r.status == 200
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = _infer_request()
            await stub.ModelInfer(request, timeout=10)
            assert time.monotonic() - signalled < grace_s, "the checks outlasted the grace"
            await channel.close()

    try:
        asyncio.run(scenario())
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log_text()
    assert log.index("serving on for drain_grace_s (4 s)") < log.index("listeners closed")
    assert _answered(server) == Counter({"http ok": 3, "grpc ok": 1})


@pytest.mark.parametrize("grace", [-1])
def test_negative_grace_is_refused(model_dir, tmp_path, grace):
    from aserve.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="drain_grace_s"):
        load_config(_config(model_dir, tmp_path, drain_grace_s=grace))


def test_a_stream_running_at_drain_timeout_ends_with_an_error_event(decoder_models, tmp_path):
    import orjson
    from helpers import frozen

    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    server = start_server(write_config(tmp_path, {"models": [gpt2], "drain_timeout_s": 1}))

    async def scenario() -> list[Any]:
        body = {"model": "gpt2", "prompt": "Hi", "max_tokens": 100, "stream": True}
        body["ignore_eos"] = True
        async with aiohttp.ClientSession() as session:
            async with session.post(server.base + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # the stream is running
                (child,) = server.spawned_children()
                # Its step process held stopped: the stream outlasts drain_timeout_s.
                with frozen(child.pid):
                    server.proc.send_signal(signal.SIGTERM)
                    events = (await asyncio.wait_for(r.content.read(), 30)).split(b"\n\n")
        return [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]

    try:
        docs = asyncio.run(scenario())
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert docs[-1]["error"]["message"] == "model 'gpt2/1' is unloading", docs[-1]
    assert "requests still in flight after drain_timeout_s (1 s)" in server.log_text()
