"""API keys and TLS over HTTP: an aiohttp middleware, the server's TLS context
(frontends layer; the middleware runs on the loop, before every handler).

A request without a valid ``Authorization: Bearer KEY`` is answered 401 with
``WWW-Authenticate: Bearer`` and its connection closed; one with a valid key
of a role its route does not allow (:mod:`aserve.frontends.roles`), 403 naming
the role it needs. Paths in ``auth.open_paths`` are served without a key,
unless their route needs an admin key (see :mod:`aserve.frontends.auth`).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from aserve.config import TlsConfig
from aserve.frontends.auth import ApiKeys, refused
from aserve.frontends.roles import NOT_FOUND_ROUTE, Role, forbidden, http_role


def http_middleware(keys: ApiKeys, open_paths: Iterable[str]) -> Any:
    """An aiohttp middleware that refuses requests without a valid key."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def require_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        held = keys.check(request.headers.get("Authorization"))
        resource = request.match_info.route.resource  # None: aiohttp's own answer
        template = resource.canonical if resource is not None else NOT_FOUND_ROUTE
        needed = http_role(template, request.path)
        if request.path in open_set and needed is Role.INFERENCE:
            response = await handler(request)
            if not isinstance(held, Role):
                # Served without a key (a probe): no keep-alive either, so an
                # unauthenticated client cannot hold a connection by polling health.
                response.force_close()
            return response
        if isinstance(held, Role):
            if held.allows(needed):
                return await handler(request)
            why = forbidden(_route_name(request, template), needed, keys.has_admin_keys)
            refused("refused an HTTP request from %s: %s", request.remote, why)
            return web.Response(
                status=403, body=orjson.dumps({"error": why}), content_type="application/json"
            )
        refused("refused an HTTP request from %s without a valid API key: %s",
                        request.remote, held)  # fmt: skip
        response = web.Response(
            status=401,
            body=orjson.dumps({"error": held}),
            content_type="application/json",
            headers={"WWW-Authenticate": "Bearer"},
        )
        # No keep-alive without a key: an unauthenticated client holds no
        # connection (nor a slot of limits.max_connections) past its answer.
        response.force_close()
        return response

    return require_key


def _route_name(request: web.Request, template: str) -> str:
    if template != NOT_FOUND_ROUTE:
        return f"{request.method} {template}"
    # No route there (a reserved admin path): the path, kept short and printable.
    shown = request.path[:100].encode("ascii", "backslashreplace").decode()
    return f"{request.method} {shown}"


def server_ssl_context(tls: TlsConfig, base_dir: Path) -> ssl.SSLContext:
    """The HTTP frontend's TLS context; OSError (ssl.SSLError) when the files do not do."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(base_dir / tls.cert_file, base_dir / tls.key_file)
    return context
