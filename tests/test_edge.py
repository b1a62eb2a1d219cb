"""The server's edge under hostile clients: connections that never send a
request, credentials that are not text, and what that costs in the log."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import resource
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from stall_watch import watch_loop

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.config import ConfigError, parse_config
from aserve.frontends.http.limits import accept_error_handler
from aserve.obs.log_throttle import Throttled

pytestmark = pytest.mark.timeout(120)

KEYS_ENV = "ASERVE_TEST_EDGE_KEYS"
KEY = "edge-key"
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
INFER = "/v2/models/affine/infer"


def _affine(model_dir: Path) -> dict[str, Any]:
    return model_entry(
        "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("OUTPUT0", "FP32", [16])],
    )  # fmt: skip


def _raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send one request as raw bytes; the whole answer (the server closes or we read it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status_and_doc(answer: bytes) -> tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body) if body.startswith(b"{") else body


# --- credentials that are not text --------------------------------------------------


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("edge-auth")
    config = {
        "auth": {"api_keys_env": KEYS_ENV},
        "grpc": {"port": 0},
        "models": [_affine(model_dir)],
    }
    srv = start_server(write_config(folder, config), extra_env={KEYS_ENV: KEY})
    yield srv
    srv.stop()


JUNK_AUTHORIZATIONS = [
    b"Bearer \xff\xfe\xfd",
    b"Bearer caf\xe9",  # latin-1
    b"\xc3\x28\xa0\xa1",  # broken UTF-8
    b"Bearer edge-key\x80",
]


def test_a_non_utf8_authorization_is_401_and_costs_at_most_a_log_line(
    keyed: ServerProcess,
) -> None:
    body = orjson.dumps(BODY)
    before = len(keyed.log_text())

    async def storm() -> None:
        async with watch_loop(keyed.base):
            for i in range(100):
                junk = JUNK_AUTHORIZATIONS[i % len(JUNK_AUTHORIZATIONS)]
                head = b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + junk
                head += b"\r\nContent-Type: application/json\r\n"
                status, doc = await asyncio.to_thread(
                    _status_and_doc, _raw_request(keyed.port, head, body)
                )
                assert status == 401, doc
                assert "API key" in doc["error"] or "authorization" in doc["error"], doc

    asyncio.run(storm())
    # A keyed request still works.
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    head += b"Content-Type: application/json\r\n"
    status, doc = _status_and_doc(_raw_request(keyed.port, head, body))
    assert status == 200, doc
    log = keyed.log_text()[before:]
    assert "Traceback" not in log, log[:3000]
    assert len(log.splitlines()) <= 3, log[:3000]


def test_without_a_key_a_client_holds_no_connection_past_its_answer(
    keyed: ServerProcess,
) -> None:
    """Else unauthenticated clients could fill limits.max_connections by
    polling an open path (health) on kept-alive connections."""
    for path, auth, kept in [
        ("/v2/health/live", b"", False),
        (INFER, b"", False),  # 401
        ("/v2/health/live", f"Authorization: Bearer {KEY}\r\n".encode(), True),
    ]:
        with socket.create_connection(("127.0.0.1", keyed.port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + auth + b"\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            assert (b"Connection: close" not in head) is kept, (path, head)
            if not kept:
                assert _closed_by_server(sock, 20), path


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (b"aserve-timeout-ms: \xff\xfe", "aserve-timeout-ms"),
        (b"Content-Encoding: gz\xe9ip", "Content-Encoding"),
    ],
)
def test_undecodable_header_bytes_with_a_key_are_a_400_naming_the_header(
    keyed: ServerProcess, header: bytes, words: str
) -> None:
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    head += b"Content-Type: application/json\r\n" + header + b"\r\n"
    before = len(keyed.log_text())
    status, doc = _status_and_doc(_raw_request(keyed.port, head, orjson.dumps(BODY)))
    assert status == 400, doc
    assert words in doc["error"], doc
    assert "Traceback" not in keyed.log_text()[before:]


def test_grpc_bad_authorization_metadata_is_unauthenticated(keyed: ServerProcess) -> None:
    async def calls() -> None:
        async with grpc.aio.insecure_channel(keyed.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="affine")
            # gRPC clients refuse non-ASCII text metadata; binary metadata
            # ("-bin") carries any bytes. (The server refuses any that reach
            # it, as over HTTP; grpc.aio has no client that sends them.)
            for metadata in (
                (("authorization-bin", b"\xff\xfe"),),
                (("authorization", "Bearer"),),
                (("authorization", "Bearer " + "x" * 4000),),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.ModelInfer(request, metadata=metadata, timeout=10)
                assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED, metadata

    before = len(keyed.log_text())
    asyncio.run(calls())
    assert "Traceback" not in keyed.log_text()[before:]


# --- connections that hold without asking -------------------------------------------


def _edge_server(model_dir: Path, folder: Path, http: dict, limits: dict) -> ServerProcess:
    """A server with API keys: the hostile sockets have none, the test's clients do."""
    config = {
        "http": http, "limits": limits, "auth": {"api_keys_env": KEYS_ENV},
        "grpc": {"port": 0}, "models": [_affine(model_dir)],
    }  # fmt: skip
    return start_server(write_config(folder, config), extra_env={KEYS_ENV: KEY})


@pytest.fixture(scope="module")
def short_timeouts(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = _edge_server(
        model_dir, tmp_path_factory.mktemp("edge-timeouts"),
        {"header_timeout_s": 1.0, "keepalive_timeout_s": 1.5},
        {"max_connections": 4},
    )  # fmt: skip
    yield srv
    srv.stop()


def _open_idle(port: int, n: int, send: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if send:
            sock.sendall(send)
        socks.append(sock)
    return socks


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True once the server closes ``sock`` (EOF or reset) within ``within_s``;
    what it sends before (gRPC's settings frame) is read and dropped."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


async def _keyed_infers(base: str, n: int) -> list[int]:
    """``n`` requests, each on a fresh connection (a new client's first request)."""
    statuses = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for _ in range(n):
            auth = {"Authorization": f"Bearer {KEY}"}  # servers without keys ignore it
            async with s.post(base + INFER, json=BODY, headers=auth) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


PARTIAL_HEADS = [b"", b"POST /v2/mod", b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"]


def test_sockets_without_a_complete_head_neither_count_nor_stay(
    short_timeouts: ServerProcess,
) -> None:
    srv = short_timeouts
    # 30 sockets, 7 times limits.max_connections, that never finish a head.
    socks = [s for head in PARTIAL_HEADS for s in _open_idle(srv.port, 10, head)]
    try:

        async def meanwhile() -> list[int]:
            async with watch_loop(srv.base):
                return await _keyed_infers(srv.base, 20)

        # Before the fix, every one of these was answered 429 while the sockets were held.
        assert asyncio.run(meanwhile()) == [200] * 20
        # header_timeout_s is 1 s; the bound here is a loose watchdog.
        still_open = [s for s in socks if not _closed_by_server(s, 20)]
        assert not still_open, f"{len(still_open)} of {len(socks)} sockets were never closed"
    finally:
        for s in socks:
            s.close()
    text = urllib.request.urlopen(srv.base + "/metrics", timeout=10).read().decode()
    assert 'reason="header_timeout"' in text


def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(
    short_timeouts: ServerProcess,
) -> None:
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    head += f"Authorization: Bearer {KEY}\r\n".encode()
    body = orjson.dumps(BODY)
    with socket.create_connection(("127.0.0.1", short_timeouts.port), timeout=10) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert b"Connection: close" not in answer  # kept alive ...
        assert _closed_by_server(sock, 20), "an idle connection was kept past the timeout"


@pytest.fixture(scope="module")
def few_pending(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = _edge_server(
        model_dir, tmp_path_factory.mktemp("edge-pending"),
        {"header_timeout_s": 300.0}, {"max_pending_connections": 8},
    )  # fmt: skip
    yield srv
    srv.stop()


def test_pending_connections_have_a_bound_of_their_own(few_pending: ServerProcess) -> None:
    srv = few_pending
    socks: list[socket.socket] = []

    async def case() -> None:
        async with watch_loop(srv.base):
            socks.extend(await asyncio.to_thread(_open_idle, srv.port, 40))
            # The server closes the oldest beyond 8; the header timeout (300 s) is no help.
            closed = await asyncio.to_thread(
                lambda: [s for s in socks[:32] if _closed_by_server(s, 20)]
            )
            assert len(closed) == 32
            assert await _keyed_infers(srv.base, 10) == [200] * 10

    try:
        asyncio.run(case())
    finally:
        for s in socks:
            s.close()


# --- file descriptors -----------------------------------------------------------------


def _nofile_env(folder: Path, soft: int, hard: int | None = None) -> dict[str, str]:
    """Environment that starts the server with RLIMIT_NOFILE (soft, hard), as a
    system with a low default does: a sitecustomize sets it before aserve runs."""
    hard_text = "hard" if hard is None else str(hard)
    (folder / "sitecustomize.py").write_text(
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard_text}))\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def test_the_soft_open_file_limit_is_raised_to_the_hard_one_at_start(
    model_dir: Path, tmp_path: Path
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open file limit here leaves nothing to raise")
    config = {"models": [_affine(model_dir)]}
    srv = start_server(write_config(tmp_path, config), extra_env=_nofile_env(tmp_path, 256))
    try:
        assert re.search(
            r"raised the open file limit \(RLIMIT_NOFILE\) from 256 to \d+", srv.log_text()
        ), srv.log_text()
    finally:
        srv.stop()


def _open_serving(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each made a request and stay open (keep-alive);
    those the OS refuses are left out."""
    socks = []
    for _ in range(n):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        except OSError:
            continue
        socks.append(sock)
    return socks


def _wait_for_log(srv: ServerProcess, start: int, words: str) -> str:
    deadline = time.monotonic() + 20
    while words not in srv.log_text()[start:]:
        assert time.monotonic() < deadline, srv.log_text()[start:]
        time.sleep(0.05)
    return srv.log_text()[start:]


def _infer_when_back(base: str) -> list[int]:
    deadline = time.monotonic() + 20
    while True:
        try:
            return asyncio.run(_keyed_infers(base, 1))
        except aiohttp.ClientError:
            assert time.monotonic() < deadline, "the server never answered again"
            time.sleep(0.1)


def test_idle_sockets_cannot_exhaust_descriptors_and_exhaustion_is_logged_once(
    model_dir: Path, tmp_path: Path
) -> None:
    limit = 200  # RLIMIT_NOFILE, soft and hard: nothing to raise
    config = {"http": {"header_timeout_s": 300.0}, "models": [_affine(model_dir)]}
    srv = start_server(
        write_config(tmp_path, config), extra_env=_nofile_env(tmp_path, limit, limit)
    )
    try:
        _wait_for_log(srv, 0, "max_pending_connections 1024 lowered to")
        # Idle sockets past the limit: before the fix the server ran out of
        # descriptors and new clients were reset.
        idle = _open_idle(srv.port, limit + 100)
        try:

            async def meanwhile() -> list[int]:
                async with watch_loop(srv.base):
                    return await _keyed_infers(srv.base, 10)

            assert asyncio.run(meanwhile()) == [200] * 10
        finally:
            for s in idle:
                s.close()
        # Connections that made a request (no max_connections set) can run the
        # descriptors out: that is logged once, and the server recovers.
        before = len(srv.log_text())
        serving = _open_serving(srv.port, limit + 50)
        try:
            _wait_for_log(srv, before, "near the open file limit")
        finally:
            for s in serving:
                s.close()
        assert _infer_when_back(srv.base) == [200]
        log = srv.log_text()[before:]
        assert log.count("near the open file limit") == 1, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def test_sockets_on_the_grpc_port_cannot_exhaust_descriptors(
    model_dir: Path, tmp_path: Path
) -> None:
    limit = 200  # RLIMIT_NOFILE, soft and hard
    config = {
        "http": {"header_timeout_s": 300.0},
        "grpc": {"port": 0},
        "models": [_affine(model_dir)],
    }
    srv = start_server(
        write_config(tmp_path, config), extra_env=_nofile_env(tmp_path, limit, limit)
    )
    try:
        assert srv.grpc_port is not None
        idle: list[socket.socket] = []

        async def case() -> None:
            async with watch_loop(srv.base):
                idle.extend(await asyncio.to_thread(_open_idle, srv.grpc_port, limit + 100))
                assert await _keyed_infers(srv.base, 10) == [200] * 10

        try:
            asyncio.run(case())
        finally:
            for s in idle:
                s.close()

        async def grpc_call() -> None:
            async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                await stub.ServerLive(pb.ServerLiveRequest(), timeout=20, wait_for_ready=True)

        asyncio.run(grpc_call())
    finally:
        srv.stop()


def test_grpc_closes_a_connection_that_never_starts_http2(short_timeouts: ServerProcess) -> None:
    port = short_timeouts.grpc_port
    assert port is not None
    socks = _open_idle(port, 5) + _open_idle(port, 5, b"PRI * HTTP/2.0\r\n")
    try:
        # grpc's server_handshake_timeout_ms is http.header_timeout_s (1 s here);
        # its own default is 120 s. The bound is a loose watchdog.
        still_open = [s for s in socks if not _closed_by_server(s, 20)]
        assert not still_open, f"{len(still_open)} of {len(socks)} were never closed"
    finally:
        for s in socks:
            s.close()


# --- the pieces, without a server ---------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture(name: str) -> _Lines:
    lines = _Lines()
    logger = logging.getLogger(name)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    return lines


def test_a_throttled_line_logs_the_first_event_then_one_per_interval_with_a_count() -> None:
    now = [0.0]
    lines = _capture("aserve.test.throttle")
    throttled = Throttled(logging.getLogger("aserve.test.throttle"), logging.WARNING, 10.0,
                          lambda: now[0])  # fmt: skip
    assert throttled.event("junk from %s", "a")
    for _ in range(99):
        assert not throttled.event("junk from %s", "b")
    now[0] = 10.0
    assert throttled.event("junk from %s", "c")
    logging.getLogger("aserve.test.throttle").removeHandler(lines)
    assert lines.lines == [
        "junk from a",
        "junk from c (and 99 more like it since the last such line)",
    ]


def test_accept_errors_for_want_of_descriptors_are_one_line() -> None:
    passed_on: list[dict[str, Any]] = []
    handle = accept_error_handler(lambda loop, context: passed_on.append(context))
    captured = _capture("aserve.http")
    loop = asyncio.new_event_loop()
    try:
        for _ in range(50):
            handle(loop, {"message": "socket.accept() out of system resource",
                          "exception": OSError(errno.EMFILE, "Too many open files")})  # fmt: skip
        handle(loop, {"message": "something else", "exception": ValueError("x")})
    finally:
        loop.close()
        logging.getLogger("aserve.http").removeHandler(captured)
    lines = captured.lines
    assert len(lines) == 1 and "Too many open files" in lines[0], lines
    assert [c["message"] for c in passed_on] == ["something else"]


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"http": {"header_timeout_s": 0}}, "http.header_timeout_s"),
        ({"http": {"keepalive_timeout_s": float("inf")}}, "http.keepalive_timeout_s"),
        ({"limits": {"max_pending_connections": 0}}, "limits.max_pending_connections"),
        ({"limits": {"max_timeout_ms": float("nan")}}, "limits.max_timeout_ms"),
        ({"limits": {"max_timeout_ms": -1}}, "limits.max_timeout_ms"),
    ],
)
def test_edge_settings_are_checked_naming_the_json_path(config: dict, path: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(path)):
        parse_config(config)
