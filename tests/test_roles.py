"""API key roles: every route of both frontends, asked with no key, an inference key
and an admin key, on a real server with real clients.

The routes are enumerated, not listed here: HTTP from the aiohttp app's router
(a server built in this process from the same config), gRPC from the running
server's reflection and the service descriptors it sends. A route added later
without a role in :mod:`aserve.frontends.roles` fails
``test_every_route_has_a_role``; one whose role lets the wrong key through
fails the tables below.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tritonclient.utils import InferenceServerException

from aserve.config import AuthConfig, ConfigError, parse_config
from aserve.frontends.auth import load_api_keys
from aserve.frontends.roles import (
    ADMIN_PATH_PREFIXES,
    GRPC_METHODS,
    HTTP_ROUTES,
    NOT_FOUND_ROUTE,
    Role,
    http_role,
)

pytestmark = pytest.mark.timeout(120)

KEYS_ENV, ADMIN_ENV = "ASERVE_TEST_INFERENCE_KEYS", "ASERVE_TEST_ADMIN_KEYS"
INFERENCE_KEY, ADMIN_KEY = "inference-key", "admin-key"
CREDENTIALS = {"no key": None, "inference key": INFERENCE_KEY, "admin key": ADMIN_KEY}
OPEN_PATHS = AuthConfig(api_keys_env="X").open_paths  # the default
AUTH_CODES = (401, 403)
GRPC_AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
FORBIDDEN = "needs an admin API key; this key is an inference key"
# Triton's RPCs that are not offered yet: admin's once they are.
RESERVED_RPCS = [
    m
    for m, role in GRPC_METHODS.items()
    if role is Role.ADMIN
    and "/Repository" not in m
    and "/SystemSharedMemory" not in m
    and "/CudaSharedMemory" not in m
]


def _config(model_dir: Path, **auth: Any) -> dict[str, Any]:
    return {
        "auth": auth,
        "grpc": {"port": 0},
        "models": [
            model_entry(
                "affine", str(model_dir / "affine.pt"),
                [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
            )
        ],
    }  # fmt: skip


ROLES_AUTH = {"api_keys_env": KEYS_ENV, "admin_keys_file": "admin-keys.txt"}


@pytest.fixture(scope="module")
def roles_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("roles")
    (folder / "admin-keys.txt").write_text(f"# operators\n{ADMIN_KEY}\n")
    config = write_config(folder, _config(model_dir, **ROLES_AUTH))
    srv = start_server(config, extra_env={KEYS_ENV: f"{INFERENCE_KEY},other-inference-key"})
    yield srv, folder
    srv.stop()


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def http(srv: ServerProcess, method: str, path: str, key: str | None) -> tuple[int, bytes]:
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(srv.base + path, data=data, method=method, headers=_headers(key))
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _served_http_routes(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(method, template) of every route of the app, built in this process from the
    same config as the server under test."""
    from aserve.server import Server

    monkeypatch.setenv(KEYS_ENV, INFERENCE_KEY)
    config = parse_config(orjson.loads((folder / "config.json").read_bytes()))
    server = Server(config, folder)
    routes = []
    for resource in server.http._app.router.resources():
        methods = sorted({r.method for r in resource} - {"*"}) or ["GET"]  # the 404 takes any
        routes += [(m, resource.canonical) for m in methods]
    return routes


def _concrete(template: str) -> str:
    # A model that does not exist: an admin route that lets a key through answers 404,
    # and changes nothing.
    return template.format(model="nosuch", version="1", tail="no/such/route", name="nosuch")


def test_every_route_has_a_role(roles_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, folder = roles_server
    served = {template for _, template in _served_http_routes(folder, monkeypatch)}
    assert sorted(served - set(HTTP_ROUTES) - {NOT_FOUND_ROUTE}) == [], "HTTP routes with no role"
    assert sorted(set(HTTP_ROUTES) - served) == [], "roles of HTTP routes that are not served"
    offered = {f"/{s.full_name}/{m.name}" for s in _grpc_services(srv) for m in s.methods}
    assert sorted(offered - set(GRPC_METHODS)) == [], "gRPC methods with no role"
    assert sorted(set(GRPC_METHODS) - offered - set(RESERVED_RPCS)) == [], "stale gRPC roles"


def test_every_http_route_with_each_role(
    roles_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, folder = roles_server
    routes = _served_http_routes(folder, monkeypatch)
    reserved = [("POST", p + "/region/x/register") for p in ADMIN_PATH_PREFIXES]
    wrong = []
    for method, target in [(m, _concrete(t)) for m, t in routes] + reserved:
        template = next((t for m, t in routes if _concrete(t) == target), NOT_FOUND_ROUTE)
        needed = http_role(template, target)
        for who, key in CREDENTIALS.items():
            status, body = http(srv, method, target, key)
            if key is None and not (target in OPEN_PATHS and needed is Role.INFERENCE):
                ok = status == 401 and b"missing API key" in body
            elif key == INFERENCE_KEY and needed is Role.ADMIN:
                ok = status == 403 and FORBIDDEN in orjson.loads(body)["error"]
            else:
                ok = status not in AUTH_CODES
            if not ok:
                wrong.append(f"{method} {target} with {who}: {status} {body[:120]!r}")
    assert wrong == []


def test_every_grpc_method_with_each_role(roles_server: Any) -> None:
    srv, _ = roles_server
    wrong = []
    with grpc.insecure_channel(srv.grpc_url) as channel:
        methods = [(s.full_name, m) for s in _grpc_services(srv) for m in s.methods]
        for service, method in methods:
            path = f"/{service}/{method.name}"
            needed = GRPC_METHODS[path]
            for who, key in CREDENTIALS.items():
                code = _call(channel, method, path, key)
                if key is None and not service.startswith("grpc.health"):
                    ok = code == grpc.StatusCode.UNAUTHENTICATED
                elif key == INFERENCE_KEY and needed is Role.ADMIN:
                    ok = code == grpc.StatusCode.PERMISSION_DENIED
                else:
                    ok = code not in GRPC_AUTH_CODES
                if not ok:
                    wrong.append(f"{path} with {who}: {code}")
        # Not offered yet; an inference key is refused them already.
        for path in RESERVED_RPCS:
            for who, key in CREDENTIALS.items():
                code = _call(channel, None, path, key)
                want = {
                    None: grpc.StatusCode.UNAUTHENTICATED,
                    INFERENCE_KEY: grpc.StatusCode.PERMISSION_DENIED,
                    ADMIN_KEY: grpc.StatusCode.UNIMPLEMENTED,
                }[key]
                if code != want:
                    wrong.append(f"{path} with {who}: {code}, not {want}")
    assert wrong == []


def test_an_inference_key_cannot_unload_a_model_and_an_admin_key_can(roles_server: Any) -> None:
    srv, _ = roles_server
    as_inference = httpclient.InferenceServerClient(srv.url)
    inference, admin = _headers(INFERENCE_KEY), _headers(ADMIN_KEY)
    with pytest.raises(InferenceServerException) as refused:
        as_inference.unload_model("affine", headers=inference)
    assert refused.value.status() == "403"
    assert refused.value.message() == (
        "POST /v2/repository/models/{model}/unload needs an admin API key; "
        "this key is an inference key"
    )
    assert as_inference.is_model_ready("affine", headers=inference)  # still served

    as_inference.unload_model("affine", headers=admin)
    assert not as_inference.is_model_ready("affine", headers=inference)
    as_inference.load_model("affine", headers=admin)
    assert as_inference.is_model_ready("affine", headers=inference)
    index = as_inference.get_model_repository_index(headers=admin)
    assert [m["name"] for m in index] == ["affine"]

    inference, admin = ({k.lower(): v for k, v in h.items()} for h in (inference, admin))
    with grpcclient.InferenceServerClient(srv.grpc_url) as client:  # gRPC metadata: lower case
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_repository_index(headers=inference)
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "RepositoryIndex needs an admin API key" in refused.value.message()
        index = client.get_model_repository_index(headers=admin, as_json=True)
        assert [m["name"] for m in index["models"]] == ["affine"]
        assert client.is_model_ready("affine", headers=admin)  # admin keys infer too


def test_a_config_with_only_inference_keys_keeps_serving_and_refuses_admin_routes(
    model_dir: Path, tmp_path: Path
) -> None:
    config = write_config(tmp_path, _config(model_dir, api_keys_env=KEYS_ENV))
    srv = start_server(config, extra_env={KEYS_ENV: INFERENCE_KEY})
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                            "data": [1.0] * 16}]}  # fmt: skip
        req = urllib.request.Request(
            srv.base + "/v2/models/affine/infer", data=orjson.dumps(body),
            headers=_headers(INFERENCE_KEY),
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        status, answer = http(srv, "POST", "/v2/repository/models/affine/unload", INFERENCE_KEY)
        assert status == 403
        assert orjson.loads(answer)["error"] == (
            "POST /v2/repository/models/{model}/unload needs an admin API key, and none is "
            "configured: set auth.admin_keys_env or auth.admin_keys_file (inference keys may "
            "not use it)"
        )
        status, _ = http(srv, "GET", "/v2/config/status", INFERENCE_KEY)
        assert status == 403
        with grpc.insecure_channel(srv.grpc_url) as channel:
            code = _call(channel, None, "/inference.GRPCInferenceService/RepositoryIndex",
                         INFERENCE_KEY)  # fmt: skip
            assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        srv.stop()


def test_role_config_errors_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, "a,b")
    monkeypatch.setenv(ADMIN_ENV, "c")
    keys = load_api_keys(AuthConfig(api_keys_env=KEYS_ENV, admin_keys_env=ADMIN_ENV), tmp_path)
    assert [keys.check(f"Bearer {k}") for k in "abc"] == [Role.INFERENCE, Role.INFERENCE,
                                                          Role.ADMIN]  # fmt: skip
    assert keys.check("Bearer d") == "invalid API key" and keys.has_admin_keys
    only_admin = load_api_keys(AuthConfig(admin_keys_env=ADMIN_ENV), tmp_path)
    assert only_admin.check("Bearer c") is Role.ADMIN and only_admin.check("Bearer a") == (
        "invalid API key"
    )
    monkeypatch.setenv(ADMIN_ENV, "b")
    with pytest.raises(ValueError, match=r"auth: 1 key\(s\) are both inference and admin keys"):
        load_api_keys(AuthConfig(api_keys_env=KEYS_ENV, admin_keys_env=ADMIN_ENV), tmp_path)
    monkeypatch.delenv(ADMIN_ENV)
    with pytest.raises(ValueError, match=f"auth.admin_keys_env: environment variable {ADMIN_ENV}"):
        load_api_keys(AuthConfig(api_keys_env=KEYS_ENV, admin_keys_env=ADMIN_ENV), tmp_path)
    (tmp_path / "empty.txt").write_text("# nobody yet\n")
    with pytest.raises(ValueError, match=r"auth: no admin keys found in empty\.txt"):
        load_api_keys(AuthConfig(api_keys_env=KEYS_ENV, admin_keys_file="empty.txt"), tmp_path)
    opened = AuthConfig(api_keys_env=KEYS_ENV, open_paths=["/v2/health/live", "/v2/config/status"])
    with pytest.raises(ValueError, match="open_paths: /v2/config/status is an admin route"):
        load_api_keys(opened, tmp_path)
    with pytest.raises(ConfigError, match="admin_keys_env must name another variable"):
        parse_config({"auth": {"api_keys_env": "K", "admin_keys_env": "K"}, "models": []})


# --- gRPC, generically ------------------------------------------------------------------


class _WithKey(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the admin key to every call (reflection, which the descriptor database calls)."""

    def _add(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {ADMIN_KEY}")]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._add(details), request)

    def intercept_stream_stream(self, continuation: Callable, details: Any, requests: Any) -> Any:
        return continuation(self._add(details), requests)


def _grpc_services(srv: ServerProcess) -> list[Any]:
    """The service descriptors of every service the server offers, from its reflection."""
    channel = grpc.intercept_channel(grpc.insecure_channel(srv.grpc_url), _WithKey())
    with channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(db)
        names = db.get_services()
        assert "inference.GRPCInferenceService" in names and "grpc.health.v1.Health" in names
        return [pool.FindServiceByName(name) for name in names]


def _call(
    channel: grpc.Channel, method: MethodDescriptor | None, path: str, key: str | None
) -> grpc.StatusCode:
    """Call ``path`` with an empty request; OK once it answered a message."""
    metadata = [("authorization", f"Bearer {key}")] if key else []
    if method is None:  # no descriptor: an empty message is empty bytes
        request: Any = b""
        serialize: Callable[[Any], bytes] = bytes
        streams = (False, False)
    else:
        request = message_factory.GetMessageClass(method.input_type)()
        serialize = type(request).SerializeToString
        streams = (method.client_streaming, method.server_streaming)
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, True): channel.stream_stream,
    }[streams]
    call = kind(path, request_serializer=serialize, response_deserializer=bytes)
    try:
        if streams == (False, False):
            call(request, metadata=metadata, timeout=30)
            return grpc.StatusCode.OK
        responses = call(iter([request]) if streams[0] else request, metadata=metadata, timeout=30)
        try:
            next(responses)  # the first message: past the interceptor
        finally:
            responses.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    except StopIteration:  # the stream ended without a message, with OK
        return grpc.StatusCode.OK
