"""API keys and TLS over gRPC: a server interceptor, the server's credentials
(frontends layer; the interceptor runs on the loop, before every call).

A call without a valid ``authorization: Bearer KEY`` metadata entry ends
``UNAUTHENTICATED``; one with a valid key of a role its method does not allow
(:mod:`aserve.frontends.roles`), ``PERMISSION_DENIED`` naming the role it
needs. The health service is open when a health path is in
``auth.open_paths`` (see :mod:`aserve.frontends.auth`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from aserve.config import TlsConfig
from aserve.frontends.auth import ApiKeys, refused
from aserve.frontends.roles import Role, forbidden, grpc_role

_HEALTH_SERVICE = "/grpc.health.v1.Health/"


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
        held = self._keys.check(authorization)
        handler = await continuation(details)
        if isinstance(held, Role):
            needed = grpc_role(details.method, served=handler is not None)
            if held.allows(needed):
                return handler
            why = forbidden(details.method[:200], needed, self._keys.has_admin_keys)
            refused("refused a gRPC call: %s", why)
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, why)
        refused("refused a gRPC call of %.100r without a valid API key: %s",
                        details.method, held)  # fmt: skip
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, held)


def _refusing(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

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


def grpc_server_credentials(tls: TlsConfig, base_dir: Path) -> grpc.ServerCredentials:
    """The gRPC frontend's TLS credentials; OSError when the files cannot be read."""
    cert = (base_dir / tls.cert_file).read_bytes()
    key = (base_dir / tls.key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])
