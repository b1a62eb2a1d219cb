"""The server's edge under hostile clients: connections that never send a
request, credentials that are not text, and what that costs in the log."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from stall_watch import watch_loop

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

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
