"""API keys over HTTP and gRPC, TLS on both frontends, and /openapi.json."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
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
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.config import AuthConfig, ConfigError, parse_config
from aserve.frontends.auth import load_api_keys
from aserve.frontends.http.openapi import build_document
from aserve.frontends.roles import Role

pytestmark = pytest.mark.timeout(90)

KEYS_ENV = "ASERVE_TEST_API_KEYS"
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}


def _affine(model_dir: Path) -> dict[str, Any]:
    return model_entry(
        "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("OUTPUT0", "FP32", [16])],
    )  # fmt: skip


def request(
    url: str, doc: Any = None, headers: dict[str, str] | None = None, context: Any = None
) -> tuple[int, dict[str, str], bytes]:
    data = doc if doc is None or isinstance(doc, bytes) else orjson.dumps(doc)
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# --- API keys -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("auth")
    config = {
        "auth": {"api_keys_env": KEYS_ENV},
        "grpc": {"port": 0},
        "models": [_affine(model_dir)],
    }
    srv = start_server(write_config(folder, config), extra_env={KEYS_ENV: "first-key, second-key"})
    yield srv
    srv.stop()


def test_http_needs_a_key_but_on_open_paths(keyed: ServerProcess) -> None:
    infer = keyed.base + "/v2/models/affine/infer"
    status, headers, body = request(infer, BODY)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert orjson.loads(body) == {
        "error": "missing API key: send 'authorization: Bearer <key>' (HTTP header or gRPC metadata)"
    }
    status, _, body = request(infer, BODY, {"Authorization": "Bearer third-key"})
    assert (status, orjson.loads(body)) == (401, {"error": "invalid API key"})
    status, _, body = request(infer, BODY, {"Authorization": "Basic c2Vjb25kLWtleQ=="})
    assert status == 401 and "Bearer <key>" in orjson.loads(body)["error"]
    assert request(infer, BODY, {"Authorization": "Bearer second-key"})[0] == 200
    assert request(infer, BODY, {"Authorization": "bearer first-key"})[0] == 200
    assert request(keyed.base + "/v2/models/affine")[0] == 401  # metadata too
    assert request(keyed.base + "/v2/models/affine/config")[0] == 401
    # The raw body route and the NDJSON streams: refused before anything is read.
    assert request(keyed.base + "/predictions/affine", b"\xff\xd8")[0] == 401
    ndjson = {"Accept": "application/x-ndjson"}
    for path in ("/v2/models/affine/generate_stream", "/v1/chat/completions"):
        assert request(keyed.base + path, {"stream": True}, ndjson)[0] == 401
    status, _, body = request(
        keyed.base + "/predictions/affine", b"\xff\xd8", {"Authorization": "Bearer first-key"}
    )
    assert status == 400 and "python handler" in orjson.loads(body)["error"]
    assert request(keyed.base + "/openapi.json")[0] == 401
    for open_path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
        assert request(keyed.base + open_path)[0] == 200


def test_grpc_needs_a_key_but_for_health(keyed: ServerProcess) -> None:
    x = np.ones((1, 16), np.float32)
    infer = pb.ModelInferRequest(model_name="affine")
    infer.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    infer.raw_input_contents.append(x.tobytes())
    with grpc.insecure_channel(keyed.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for metadata, message in [
            ((), "missing API key"),
            ((("authorization", "Bearer nope"),), "invalid API key"),
        ]:
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(infer, metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in (refused.value.details() or "")
            with pytest.raises(grpc.RpcError) as refused:  # a streaming RPC alike
                list(stub.ModelStreamInfer(iter([infer]), metadata=metadata, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = stub.ModelInfer(
            infer, metadata=(("authorization", "Bearer first-key"),), timeout=10
        )
        assert answer.model_name == "affine" and len(answer.raw_output_contents) == 1
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_api_keys_come_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys.txt").write_text("# ops keys\nfile-key\n\n")
    monkeypatch.setenv(KEYS_ENV, "env-key,")
    keys = load_api_keys(AuthConfig(api_keys_env=KEYS_ENV, api_keys_file="keys.txt"), tmp_path)
    assert len(keys) == 2
    assert keys.check("Bearer file-key") is Role.INFERENCE
    assert keys.check("Bearer env-key") is Role.INFERENCE
    assert keys.check("Bearer ") == "invalid API key"
    monkeypatch.delenv(KEYS_ENV)
    with pytest.raises(ValueError, match=f"environment variable {KEYS_ENV} is not set"):
        load_api_keys(AuthConfig(api_keys_env=KEYS_ENV), tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(AuthConfig(api_keys_file="nope.txt"), tmp_path)
    with pytest.raises(ConfigError, match=r"auth: .*keys never go in the config"):
        parse_config({"auth": {}, "models": []})
    with pytest.raises(ConfigError, match=r"auth\.api_keys"):
        parse_config({"auth": {"api_keys": ["k"], "api_keys_env": "X"}, "models": []})


def test_missing_keys_stop_the_server_at_startup(model_dir: Path, tmp_path: Path) -> None:
    config = {"auth": {"api_keys_env": KEYS_ENV}, "models": [_affine(model_dir)]}
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(write_config(tmp_path, config)),
         "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"auth.api_keys_env: environment variable {KEYS_ENV} is not set" in result.stderr


# --- TLS ------------------------------------------------------------------------------


def _make_certificates(folder: Path) -> None:
    """A test CA and a server certificate it signs for 127.0.0.1 / localhost."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=aserve test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")  # fmt: skip
    (folder / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip


@pytest.fixture(scope="module")
def tls_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if subprocess.run(["openssl", "version"], capture_output=True).returncode != 0:
        pytest.skip("needs the openssl command to make test certificates")
    folder = tmp_path_factory.mktemp("tls")
    _make_certificates(folder)
    config = {
        "tls": {"cert_file": "server.pem", "key_file": "server.key"},
        "grpc": {"port": 0},
        "models": [_affine(model_dir)],
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--config", str(write_config(folder, config)),
         "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    ports: dict[str, int] = {}
    log: list[str] = []
    both = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if m := re.search(r"listening on https://[^:]+:(\d+)", line):
                ports["http"] = int(m.group(1))
            if m := re.search(r"gRPC \(KServe V2\) listening on \S+:(\d+)", line):
                ports["grpc"] = int(m.group(1))
            if len(ports) == 2:
                both.set()

    threading.Thread(target=pump, daemon=True).start()
    context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    try:
        assert both.wait(60), "".join(log)
        deadline = time.monotonic() + 60
        while (
            request(f"https://127.0.0.1:{ports['http']}/v2/health/ready", context=context)[0] != 200
        ):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            time.sleep(0.05)
        yield {"ports": ports, "ca": (folder / "ca.pem").read_bytes(), "context": context}
    finally:
        proc.terminate()
        proc.wait(30)


def test_https(tls_server: dict) -> None:
    port = tls_server["ports"]["http"]
    status, _, body = request(
        f"https://127.0.0.1:{port}/v2/models/affine/infer", BODY, context=tls_server["context"]
    )
    assert status == 200 and orjson.loads(body)["model_name"] == "affine"
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        request(f"https://127.0.0.1:{port}/v2/health/ready", context=ssl.create_default_context())
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # no answer in plain HTTP
        request(f"http://127.0.0.1:{port}/v2/health/ready")


def test_grpc_over_tls(tls_server: dict) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=tls_server["ca"])
    target = f"127.0.0.1:{tls_server['ports']['grpc']}"
    with grpc.secure_channel(target, credentials) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ServerReady(pb.ServerReadyRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# --- OpenAPI ----------------------------------------------------------------------------


def test_openapi_describes_every_route(tmp_path: Path) -> None:
    from aserve.server import Server

    server = Server(parse_config({"models": []}), tmp_path)
    served = {
        r.canonical
        for r in server.http._app.router.resources()
        if r.canonical not in ("/{tail}", "/v2/")
    }
    doc = build_document()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == served
    for path, item in doc["paths"].items():
        params = {p["name"] for p in item.get("parameters", [])}
        assert params == set(re.findall(r"\{(\w+)\}", path)), path


def test_openapi_is_served(keyed: ServerProcess) -> None:
    status, headers, body = request(
        keyed.base + "/openapi.json", headers={"Authorization": "Bearer first-key"}
    )
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    doc = orjson.loads(body)
    assert "/v2/models/{model}/infer" in doc["paths"] and doc["info"]["title"] == "aserve"
