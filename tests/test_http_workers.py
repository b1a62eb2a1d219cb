"""``http.workers: 2``: frontend processes serving the port for the one core, on a real server.

Each test talks to the server's public port with real clients (tritonclient
http sync and aio, aiohttp, the openai SDK); every answer names the frontend
process that served it (the ``aserve-frontend`` header), so a test knows which
one it reached. Events are ordered by what the server reports (its model
statistics, its log, a frozen worker process), never by sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import psutil
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from conftest import HANDLERS, ServerProcess, model_entry, spec, start_server, write_config
from helpers import frozen, stats, v2_body, wait_for_stats, wait_idle
from reload_helpers import wait_log

FRONTEND = "aserve-frontend"
X = np.arange(16, dtype=np.float32)
TINY_GPT2 = {
    "name": "tiny-gpt2", "engine": "decoder", "path": "builtin:tiny-gpt2", "cpu_threads": 1,
    "generation": {"max_num_seqs": 2, "max_model_len": 128, "max_tokens_default": 4},
}  # fmt: skip


def _models(model_dir: Path) -> list[dict[str, Any]]:
    return [
        model_entry(
            "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
            [spec("OUTPUT0", "FP32", [16])], batching={"max_batch_size": 32, "max_delay_ms": 1.0},
        ),
        # In a worker process that helpers.frozen holds: a test keeps a batch running.
        model_entry(
            "spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])], [spec("Y", "FP32", [1])],
            batching={"max_batch_size": 4, "max_queue_size": 2, "max_delay_ms": 0},
            executor="process",
        ),
        {
            "name": "sleepy", "engine": "python", "handler": "sleeper:Sleeper",
            "parameters": {"sleep_ms": 1000},
            "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
            "batching": {"max_batch_size": 2},
        },
    ]  # fmt: skip


def _config(model_dir: Path, folder: Path, models: list[dict[str, Any]] | None = None) -> Path:
    import shutil

    shutil.copy(HANDLERS / "sleeper.py", folder / "sleeper.py")
    config = {"http": {"workers": 2}, "models": models or _models(model_dir)}
    return write_config(folder, config)


def frontend_pids(server: ServerProcess) -> dict[int, int]:
    """Frontend index -> the pid of its newest process, from the server's log."""
    pids: dict[int, int] = {}
    for line in server.log:
        m = re.search(r"HTTP frontend process (\d+) is up \(pid (\d+)\)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    return pids


@pytest.fixture(scope="module")
def workers_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("http-workers")
    srv = start_server(_config(model_dir, folder, [*_models(model_dir), TINY_GPT2]))
    yield srv
    srv.stop()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def _post(session: aiohttp.ClientSession, url: str, body: Any, **kw: Any):
    async with session.post(url, json=body, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


async def _sessions_on_each_frontend(server: ServerProcess) -> dict[str, aiohttp.ClientSession]:
    """One single-connection session per frontend process (pid -> session): new
    connections are opened until the kernel has handed one to each."""
    found: dict[str, aiohttp.ClientSession] = {}
    for _ in range(200):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with s.get(f"{server.base}/v2/health/live") as r:
            pid = r.headers[FRONTEND]
        if pid in found:
            await s.close()
        else:
            found[pid] = s
        if len(found) == 2:
            return found
    raise AssertionError(f"200 connections all reached {list(found)}")


def test_frontends_are_separate_processes_without_torch(workers_server):
    pids = frontend_pids(workers_server)
    assert sorted(pids) == [0, 1]
    core = psutil.Process(workers_server.proc.pid)
    assert {p.pid for p in core.children()} >= set(pids.values())
    for pid in pids.values():
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps, f"frontend {pid} loaded torch"


def test_tritonclient_http_sync_json_and_binary(workers_server):
    client = httpclient.InferenceServerClient(workers_server.url, network_timeout=30)
    try:
        assert client.is_server_ready()
        for binary in (False, True):
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(X.reshape(1, 16), binary_data=binary)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
            result = client.infer("affine", [inp], outputs=[out])
            assert result.as_numpy("OUTPUT0").shape == (1, 16)
        assert client.get_model_metadata("affine")["name"] == "affine"
    finally:
        client.close()


async def test_tritonclient_http_aio(workers_server):
    client = aiohttpclient.InferenceServerClient(workers_server.url)
    try:
        inp = aiohttpclient.InferInput("X", [1, 2], "FP32")
        inp.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32), binary_data=True)
        result = await client.infer("spin", [inp])
        assert result.as_numpy("Y").tolist() == [[3.0]]
    finally:
        await client.close()


async def test_both_frontends_answer_and_metrics_count_each_request_once(workers_server):
    sessions = await _sessions_on_each_frontend(workers_server)
    url = f"{workers_server.base}/v2/models/affine/infer"
    body = v2_body("INPUT0", X.tolist(), [1, 16])
    try:
        before = await stats(next(iter(sessions.values())), workers_server.base, "affine")
        for pid, s in sessions.items():
            for _ in range(5):
                status, answer, headers = await _post(s, url, body)
                assert status == 200, answer
                assert headers[FRONTEND] == pid
        s = next(iter(sessions.values()))
        after = await stats(s, workers_server.base, "affine")
        assert after["inference_count"] - before["inference_count"] == 10
        async with s.get(f"{workers_server.base}/metrics") as r:
            text = await r.text()
        m = re.search(
            r'aserve_requests_total\{model="affine",protocol="http",status="ok",version="1"\} (\S+)',
            text,
        )
        assert m and float(m.group(1)) >= 10
        # What the frontends' side counts, summed over both.
        assert "aserve_http_frontend_processes 2.0" in text
        m = re.search(r"^aserve_http_frontend_ring_requests_total (\S+)$", text, re.M)
        assert m and float(m.group(1)) >= 10, text[-2000:]
    finally:
        for s in sessions.values():
            await s.close()


async def test_a_clients_own_arrival_header_is_not_trusted(workers_server, session):
    """The arrival stamp is the frontend's: a client's ``aserve-arrival`` of long ago
    (which would put the request past its deadline) is dropped."""
    status, answer, _ = await _post(
        session, f"{workers_server.base}/v2/models/affine/infer",
        v2_body("INPUT0", X.tolist(), [1, 16]),
        headers={"aserve-arrival": "1.0", "aserve-timeout-ms": "5000"},
    )  # fmt: skip
    assert status == 200, answer


async def test_an_openai_stream_comes_through_chunk_by_chunk(workers_server):
    client = openai.AsyncOpenAI(base_url=workers_server.base + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny-gpt2", messages=[{"role": "user", "content": "hi"}],
        max_tokens=4, temperature=0, stream=True,
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    await client.close()


async def test_client_disconnect_cancels_the_request_in_the_core(workers_server, session):
    base = workers_server.base
    url = f"{base}/v2/models/spin/infer"
    await wait_idle(session, base, "spin")
    with frozen(workers_server.worker_pid("spin")):
        held_body = v2_body("X", [0.25, 0.25], [1, 2], parameters={"timeout_ms": 60_000})
        held = asyncio.create_task(_post(session, url, held_body))
        await wait_for_stats(session, base, "spin", lambda s: s["running_batch_count"] == 1)
        before = await stats(session, base, "spin")
        queued = asyncio.create_task(_post(session, url, v2_body("X", [1.0], [1, 1])))
        await wait_for_stats(session, base, "spin", lambda s: s["pending_request_count"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gone = await wait_for_stats(
            session, base, "spin", lambda s: s["pending_request_count"] == 0
        )
        assert gone["cancelled"] == before["cancelled"] + 1
        assert not held.done()
    status, answer, _ = await held
    assert status == 200, answer


async def test_deadlines_and_refusals_keep_their_status_and_reason(workers_server, session):
    base = workers_server.base
    url = f"{base}/v2/models/spin/infer"
    await wait_idle(session, base, "spin")
    with frozen(workers_server.worker_pid("spin")):
        held_body = v2_body("X", [0.25, 0.25], [1, 2], parameters={"timeout_ms": 60_000})
        held = asyncio.create_task(_post(session, url, held_body))
        await wait_for_stats(session, base, "spin", lambda s: s["running_batch_count"] == 1)
        # A deadline from the timeout header: the request times out in the queue.
        status, answer, _ = await _post(
            session, url, v2_body("X", [1.0], [1, 1]), headers={"aserve-timeout-ms": "100"}
        )
        assert status == 504 and "timed out" in answer["error"], answer
        # A full queue: 429, its reason and Retry-After.
        small = v2_body("X", [1.0], [1, 1], parameters={"timeout_ms": 60_000})
        queued = [asyncio.create_task(_post(session, url, small)) for _ in range(2)]
        await wait_for_stats(session, base, "spin", lambda s: s["pending_request_count"] == 2)
        status, answer, headers = await _post(session, url, small)
        assert status == 429 and "max_queue_size 2" in answer["error"], answer
        assert headers["Retry-After"] == "1"
    for status, answer, _ in [await held, *await asyncio.gather(*queued)]:
        assert status == 200, answer
    # A deadline the model cannot meet (it takes a second a batch): 503 at once, with why.
    status, answer, _ = await _post(
        session, f"{base}/v2/models/sleepy/infer",
        v2_body("X", [1.0, 2.0], [1, 2], parameters={"timeout_ms": 200}),
    )  # fmt: skip
    assert status == 503 and "cannot meet the request's deadline" in answer["error"], answer


async def test_a_killed_frontend_is_restarted_and_its_sibling_unaffected(workers_server, session):
    base = workers_server.base
    sessions = await _sessions_on_each_frontend(workers_server)
    victim, sibling = list(sessions)
    url = f"{base}/v2/models/spin/infer"
    try:
        # Statistics on another session: the sibling's one connection is the held request's.
        await wait_idle(session, base, "spin")
        with frozen(workers_server.worker_pid("spin")):
            body = v2_body("X", [0.25, 0.25], [1, 2], parameters={"timeout_ms": 60_000})
            held = asyncio.create_task(_post(sessions[sibling], url, body))
            await wait_for_stats(session, base, "spin", lambda st: st["running_batch_count"] == 1)
            # The victim's own request waits in the queue behind the held batch.
            before = await stats(session, base, "spin")
            lost = asyncio.create_task(_post(sessions[victim], url, v2_body("X", [1.0], [1, 1])))
            await wait_for_stats(session, base, "spin", lambda st: st["pending_request_count"] == 1)
            os.kill(int(victim), signal.SIGKILL)
            wait_log(workers_server, f"(pid {victim}) exited with status -9")
            with pytest.raises(aiohttp.ClientError):  # its connection died with its frontend
                await lost
            # The core cancelled the victim's request, and only that one.
            after = await wait_for_stats(
                session, base, "spin", lambda st: st["pending_request_count"] == 0
            )
            assert after["cancelled"] == before["cancelled"] + 1
            index = next(i for i, p in frontend_pids(workers_server).items() if p == int(victim))
            deadline = time.monotonic() + 30
            while frontend_pids(workers_server)[index] == int(victim):
                assert time.monotonic() < deadline, workers_server.log_text()[-2000:]
                await asyncio.sleep(0.02)
            assert not held.done()
        status, answer, headers = await held  # the sibling's request, through the kill
        assert status == 200, answer
        assert headers[FRONTEND] == sibling
        # The victim's connection died with it: its client reconnects, to a live frontend.
        status, answer, headers = await _post(sessions[victim], url, v2_body("X", [1.0], [1, 1]))
        assert status == 200, answer
        assert headers[FRONTEND] != victim
    finally:
        for s in sessions.values():
            await s.close()
    # Both frontends serve again: the restarted one among them.
    sessions = await _sessions_on_each_frontend(workers_server)
    try:
        assert str(frontend_pids(workers_server)[index]) in sessions
        async with next(iter(sessions.values())).get(f"{base}/metrics") as r:
            text = await r.text()
        assert "aserve_http_frontend_restarts_total 1.0" in text
    finally:
        for s in sessions.values():
            await s.close()


def test_reload_adds_a_model_the_frontends_serve_at_once(model_dir, tmp_path):
    config = _config(model_dir, tmp_path)
    server = start_server(config)
    try:
        doc = json.loads(config.read_text())
        extra = model_entry(
            "affine2", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
            [spec("OUTPUT0", "FP32", [16])],
        )  # fmt: skip
        doc["models"].append(extra)
        config.write_text(json.dumps(doc))
        wait_log(server, "affine2")
        client = httpclient.InferenceServerClient(server.url, network_timeout=30)
        try:
            deadline = time.monotonic() + 60
            while not client.is_model_ready("affine2"):
                assert time.monotonic() < deadline, server.log_text()[-2000:]
                time.sleep(0.05)
            for _ in range(4):  # on whichever frontend each connection reaches
                inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_data_from_numpy(X.reshape(1, 16))
                assert client.infer("affine2", [inp]).as_numpy("OUTPUT0").shape == (1, 16)
        finally:
            client.close()
    finally:
        server.stop()


HTTP_CLIENTS = 32


async def _load_until_stopped(server: ServerProcess) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    failures: list[str] = []
    url = f"{server.base}/v2/models/affine/infer"
    body = v2_body("INPUT0", X.tolist(), [1, 16])

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with session.post(url, json=body) as r:
                    await r.read()
                    if r.status != 200:
                        failures.append(f"HTTP {r.status}")
                        return
                    counts["http ok"] += 1
                    counts[f"pid {r.headers[FRONTEND]}"] += 1
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, ConnectionRefusedError):
                    counts["refused"] += 1
                else:
                    failures.append(repr(exc))
                return
            except (aiohttp.ClientError, OSError) as exc:
                failures.append(repr(exc))
                return

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=HTTP_CLIENTS)) as s:
        tasks = [asyncio.create_task(client(s)) for _ in range(HTTP_CLIENTS)]
        deadline = time.monotonic() + 60
        while counts["http ok"] < 10 * HTTP_CLIENTS:
            assert time.monotonic() < deadline, counts
            assert not failures, failures
            await asyncio.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return counts, failures


def test_sigterm_under_load_answers_every_request_read(model_dir, tmp_path):
    server = start_server(_config(model_dir, tmp_path))
    try:
        counts, failures = asyncio.run(_load_until_stopped(server))
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert failures == [], (failures, counts)
    m = re.search(r"stopped; requests answered: (.*)", server.log_text())
    assert m, server.log_text()[-3000:]
    assert m.group(1) == f"http ok {counts['http ok']}", (m.group(1), counts)
    assert counts["refused"] == HTTP_CLIENTS, counts
    assert len([k for k in counts if k.startswith("pid ")]) == 2, counts  # both served
    for pid in frontend_pids(server).values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


# --- the fast path: /infer over the shared-memory rings ---------------------------

RING = "aserve-ring"
ECHO = '''
import numpy as np


class Echo:
    """X (FP32 [-1]) -> Y, its values twice: an answer twice as large as its request."""

    def load(self, context):
        pass

    def warmup_request(self):
        return {"X": np.zeros((1, 4), np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        return {"y": np.concatenate([batch["x"], batch["x"]], axis=1)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
'''


@pytest.fixture(scope="module")
def echo_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("http-workers-echo")
    (folder / "echo.py").write_text(ECHO)
    echo = {
        "name": "echo", "engine": "python", "handler": "echo:Echo",
        "inputs": [spec("X", "FP32", [-1])], "outputs": [spec("Y", "FP32", [-1])],
    }  # fmt: skip
    srv = start_server(_config(model_dir, folder, [*_models(model_dir)[:1], echo]))
    yield srv
    srv.stop()


def test_infer_json_and_binary_take_the_ring(workers_server):
    client = httpclient.InferenceServerClient(workers_server.url, network_timeout=30)
    try:
        for binary_in, binary_out in ((False, False), (True, True), (True, False)):
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(X.reshape(1, 16), binary_data=binary_in)
            out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)
            result = client.infer("affine", [inp], outputs=[out], request_id="r-7")
            assert result.get_response()["id"] == "r-7"
            assert result.as_numpy("OUTPUT0").shape == (1, 16)
    finally:
        client.close()


async def test_ring_answers_carry_the_header_and_errors_keep_their_wording(workers_server, session):
    url = f"{workers_server.base}/v2/models/affine/infer"
    status, answer, headers = await _post(session, url, v2_body("INPUT0", X.tolist(), [1, 16]))
    assert status == 200 and headers[RING] == "1", answer
    # Checked by the core against the model, over the ring: the HTTP route's message.
    status, answer, headers = await _post(session, url, v2_body("INPUT0", [0.0] * 15, [1, 15]))
    assert status == 400 and headers[RING] == "1"
    assert answer["error"] == "input 'INPUT0': shape [1, 15] does not match the model's [batch, 16]"
    # An unknown model: 404 as without frontends.
    status, answer, _ = await _post(
        session, f"{workers_server.base}/v2/models/nope/infer", v2_body("X", [1.0], [1, 1])
    )
    assert status == 404 and "nope" in answer["error"], answer
    # What the frontend cannot read goes to the core whole, which says what is wrong.
    async with session.post(url, data=b"{nope", headers={"Content-Type": JSON_TYPE}) as r:
        assert r.status == 400 and RING not in r.headers
        assert "not valid JSON" in (await r.json())["error"]


JSON_TYPE = "application/json"


async def _binary_echo(session: aiohttp.ClientSession, url: str, values: np.ndarray):
    """Post ``values`` to the echo model as a binary tensor; (status, headers, Y's bytes)."""
    body = values.tobytes()
    header = json.dumps({
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, values.size],
                    "parameters": {"binary_data_size": len(body)}}],
        "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    async with session.post(
        url, data=header + body, headers={"Inference-Header-Content-Length": str(len(header))}
    ) as r:
        raw = await r.read()
        assert r.status == 200, raw[:300]
        return r.headers, raw[int(r.headers["Inference-Header-Content-Length"]) :]


async def test_a_request_bigger_than_the_ring_is_forwarded_and_a_big_answer_comes_back(
    echo_server, session
):
    from aserve.frontends.proc.rings import RING_CAPACITY_BYTES

    url = f"{echo_server.base}/v2/models/echo/infer"
    # A request that fits the ring, its answer (twice as large) over the ring's
    # largest message (half the ring): the answer comes through the private folder.
    values = np.arange(int(RING_CAPACITY_BYTES / 2 * 0.6) // 4, dtype=np.float32)
    headers, data = await _binary_echo(session, url, values)
    assert headers[RING] == "1"
    assert data == np.tile(values, 2).tobytes()
    # A request over the ring's largest message: forwarded whole, answered the same.
    values = np.arange(RING_CAPACITY_BYTES // 4, dtype=np.float32)
    headers, data = await _binary_echo(session, url, values)
    assert RING not in headers
    assert data == np.tile(values, 2).tobytes()


# --- API keys and TLS in front of frontends ----------------------------------------


def test_api_keys_are_checked_on_both_paths(model_dir, tmp_path):
    config = {
        "http": {"workers": 2},
        "auth": {"api_keys_env": "ASERVE_TEST_WORKER_KEYS"},
        "models": _models(model_dir)[:1],
    }
    server = start_server(
        write_config(tmp_path, config), extra_env={"ASERVE_TEST_WORKER_KEYS": "k1"}
    )
    try:
        url = f"{server.base}/v2/models/affine/infer"
        body = json.dumps(v2_body("INPUT0", X.tolist(), [1, 16])).encode()
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, body), timeout=30)
        assert refused.value.code == 401
        assert "missing API key" in refused.value.read().decode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            request = urllib.request.Request(url, body, {"Authorization": "Bearer k2"})
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(url, body, {"Authorization": "Bearer k1"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200
            assert r.headers[RING] == "1"  # a valid key: the fast path
            assert r.headers[FRONTEND] in {str(p) for p in frontend_pids(server).values()}
    finally:
        server.stop()


def test_tls_is_served_by_the_frontends(model_dir, tmp_path):
    import ssl
    import subprocess
    import sys
    import threading
    import urllib.request

    from test_auth_tls_openapi import _make_certificates

    if subprocess.run(["openssl", "version"], capture_output=True).returncode != 0:
        pytest.skip("needs the openssl command to make test certificates")
    _make_certificates(tmp_path)
    config = {
        "http": {"workers": 2},
        "tls": {"cert_file": "server.pem", "key_file": "server.key"},
        "models": _models(model_dir)[:1],
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--config", str(write_config(tmp_path, config)),
         "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    found: list[int] = []
    ready = threading.Event()
    log: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if m := re.search(r"listening on https://[^:]+:(\d+)", line):
                found.append(int(m.group(1)))
            if "ready:" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(60), "".join(log)
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        url = f"https://127.0.0.1:{found[0]}/v2/models/affine/infer"
        body = json.dumps(v2_body("INPUT0", X.tolist(), [1, 16])).encode()
        with urllib.request.urlopen(
            urllib.request.Request(url, body), timeout=30, context=context
        ) as r:
            assert r.status == 200 and r.headers[RING] == "1"
            assert json.loads(r.read())["outputs"][0]["shape"] == [1, 16]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


async def test_each_frontend_bounds_its_connections_and_metrics_sum_its_refusals(
    model_dir, tmp_path
):
    config = {"http": {"workers": 2}, "limits": {"max_connections": 1}}
    server = start_server(write_config(tmp_path, {**config, "models": _models(model_dir)[:1]}))
    sessions: list[aiohttp.ClientSession] = []
    try:
        serving: dict[str, aiohttp.ClientSession] = {}
        refused = 0
        # One connection each frontend may serve; a third (or later) reaches a full one.
        while refused == 0 or len(serving) < 2:
            assert len(sessions) < 200, (serving, refused)
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            sessions.append(s)
            async with s.get(f"{server.base}/v2/health/live") as r:
                if r.status == 429:
                    assert "max_connections" in (await r.json())["error"]
                    refused += 1
                else:
                    assert r.status == 200
                    serving[r.headers[FRONTEND]] = s
        # The refusals reach the core's /metrics, summed (each frontend reports its own).
        s = next(iter(serving.values()))
        deadline = time.monotonic() + 30
        while True:
            async with s.get(f"{server.base}/metrics") as r:
                text = await r.text()
            m = re.search(
                r'^aserve_rejected_requests_total\{[^}]*reason="max_connections"[^}]*\} (\S+)$',
                text,
                re.M,
            )
            if m and float(m.group(1)) == refused:
                break
            assert time.monotonic() < deadline, (refused, m and m.group(0))
            await asyncio.sleep(0.05)
    finally:
        for s in sessions:
            await s.close()
        server.stop()


def test_ps_lists_one_server_with_its_port(model_dir, tmp_path):
    from test_ps import wait_for

    run_dir = tmp_path / "run"
    server = start_server(
        write_config(tmp_path, {"http": {"workers": 2}, "models": _models(model_dir)[:1]}),
        extra_env={"ASERVE_RUNTIME_DIR": str(run_dir)},
    )
    try:
        entries = wait_for(run_dir, lambda es: len(es) == 1 and es[0]["state"] == "ready")
        assert entries[0]["pid"] == server.proc.pid
        assert entries[0]["http"] == [f"http://127.0.0.1:{server.port}"]
    finally:
        server.stop()


async def test_a_request_held_at_sigterm_is_answered_before_the_frontends_exit(model_dir, tmp_path):
    server = start_server(_config(model_dir, tmp_path))
    try:
        async with aiohttp.ClientSession() as session:
            base, url = server.base, f"{server.base}/v2/models/spin/infer"
            await wait_idle(session, base, "spin")
            with frozen(server.worker_pid("spin")):
                body = v2_body("X", [0.25, 0.25], [1, 2], parameters={"timeout_ms": 60_000})
                held = asyncio.create_task(_post(session, url, body))
                await wait_for_stats(session, base, "spin", lambda s: s["running_batch_count"] == 1)
                server.proc.send_signal(signal.SIGTERM)
                wait_log(server, "listeners closed")
                assert not held.done()
            status, answer, headers = await held
            assert status == 200 and headers["Connection"] == "close", answer
            assert answer["outputs"][0]["data"] == [0.5]
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert "requests answered: http ok" in server.log_text()


def test_the_frontends_exit_when_the_core_is_killed(model_dir, tmp_path):
    server = start_server(_config(model_dir, tmp_path, _models(model_dir)[:1]))
    pids = list(frontend_pids(server).values())
    # python -m aserve.frontends.proc.main SPEC ...: SPEC is in the core's private folder.
    private = Path(psutil.Process(pids[0]).cmdline()[3]).parent
    assert (private / "core.sock").exists()
    server.proc.kill()
    server.proc.wait(30)
    deadline = time.monotonic() + 30
    for pid in pids:  # their control channel reached EOF: they exit at once
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
            assert time.monotonic() < deadline, f"frontend {pid} outlived its core"
            time.sleep(0.02)
    # and the private folder the killed core left is gone with them.
    assert not private.exists(), sorted(private.iterdir())
