"""API keys for both frontends, and TLS contexts (on the loop).

With ``"auth"`` in the config every request must carry one of the keys:
``Authorization: Bearer KEY`` over HTTP (an aiohttp middleware), metadata
``authorization: Bearer KEY`` over gRPC (a server interceptor). Paths in
``auth.open_paths`` (health and /metrics by default) are served without one;
over gRPC the health service is open when a health path is. A request
without a key, or with a wrong one, is answered 401 (``WWW-Authenticate:
Bearer``) / ``UNAUTHENTICATED`` before anything else happens. Without
``"auth"`` nothing is installed: the request path is unchanged.

Keys are compared in constant time, each against every configured key.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import orjson
from aiohttp import web

from aserve.config import AuthConfig, TlsConfig
from aserve.log_throttle import Throttled

log = logging.getLogger("aserve.auth")

_BEARER = "bearer "
_HEALTH_SERVICE = "/grpc.health.v1.Health/"
_MISSING = "missing API key: send 'authorization: Bearer <key>' (HTTP header or gRPC metadata)"
_WRONG = "invalid API key"
_NOT_TEXT = "the authorization must be 'Bearer <key>' in printable ASCII"
# Refusals need no credentials to cause: one line per interval, not one per request.
_refusals = Throttled(log, logging.WARNING)


class ApiKeys:
    """The accepted keys; :meth:`check` says why a credential is refused, or None."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """Why ``authorization`` (an ``Authorization`` value) is refused, or None if accepted."""
        if not authorization:
            return _MISSING
        # Undecodable bytes arrive as lone surrogates, which str.encode refuses.
        if not (authorization.isascii() and authorization.isprintable()):
            return _NOT_TEXT
        if authorization[: len(_BEARER)].lower() != _BEARER:
            return "the authorization must be 'Bearer <key>'"
        given = authorization[len(_BEARER) :].strip().encode()
        ok = False
        for key in self._keys:  # no early exit: the time does not tell which key matched
            ok |= hmac.compare_digest(given, key)
        return None if ok else _WRONG


def load_api_keys(auth: AuthConfig, base_dir: Path) -> ApiKeys:
    """Read the keys from the environment variable and/or the file; ValueError says what is wrong."""
    keys: list[str] = []
    if auth.api_keys_env is not None:
        value = os.environ.get(auth.api_keys_env)
        if value is None:
            raise ValueError(
                f"auth.api_keys_env: environment variable {auth.api_keys_env} is not set"
            )
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if auth.api_keys_file is not None:
        path = base_dir / auth.api_keys_file
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"auth.api_keys_file: cannot read {path}: {exc.strerror}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if not keys:
        raise ValueError("auth: no API keys found in " + _sources(auth))
    return ApiKeys(keys)


def _sources(auth: AuthConfig) -> str:
    names = []
    if auth.api_keys_env is not None:
        names.append(f"${auth.api_keys_env}")
    if auth.api_keys_file is not None:
        names.append(auth.api_keys_file)
    return " and ".join(names)


def http_middleware(keys: ApiKeys, open_paths: Iterable[str]) -> Any:
    """An aiohttp middleware that refuses requests without a valid key."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def require_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        why = keys.check(request.headers.get("Authorization"))
        if request.path in open_set:
            response = await handler(request)
            if why is not None:
                # Served without a key (a probe): no keep-alive either, so an
                # unauthenticated client cannot hold a connection by polling health.
                response.force_close()
            return response
        if why is None:
            return await handler(request)
        _refusals.event("refused an HTTP request from %s without a valid API key: %s",
                        request.remote, why)  # fmt: skip
        response = web.Response(
            status=401,
            body=orjson.dumps({"error": why}),
            content_type="application/json",
            headers={"WWW-Authenticate": "Bearer"},
        )
        # No keep-alive without a key: an unauthenticated client holds no
        # connection (nor a slot of limits.max_connections) past its answer.
        response.force_close()
        return response

    return require_key


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``authorization`` metadata entry."""

    def __init__(self, keys: ApiKeys, open_paths: Iterable[str]) -> None:
        self._keys = keys
        self._health_open = any(p.startswith("/v2/health") for p in open_paths)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self._health_open and details.method.startswith(_HEALTH_SERVICE):
            return await continuation(details)
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                # latin-1 decodes any bytes; check() then refuses what is not ASCII.
                authorization = value if isinstance(value, str) else bytes(value).decode("latin-1")
                break
        why = self._keys.check(authorization)
        if why is None:
            return await continuation(details)
        _refusals.event("refused a gRPC call of %.100r without a valid API key: %s",
                        details.method, why)  # fmt: skip
        handler = await continuation(details)
        return _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # an unknown method: refused all the same, not revealed
        return grpc.unary_unary_rpc_method_handler(refuse)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def server_ssl_context(tls: TlsConfig, base_dir: Path) -> ssl.SSLContext:
    """The HTTP frontend's TLS context; OSError (ssl.SSLError) when the files do not do."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(base_dir / tls.cert_file, base_dir / tls.key_file)
    return context


def grpc_server_credentials(tls: TlsConfig, base_dir: Path) -> grpc.ServerCredentials:
    """The gRPC frontend's TLS credentials; OSError when the files cannot be read."""
    cert = (base_dir / tls.cert_file).read_bytes()
    key = (base_dir / tls.key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])
