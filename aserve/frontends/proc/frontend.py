"""A frontend process's aiohttp server: its listeners, its connections, its drain
(frontends layer; in a frontend process, on its loop).

It serves the listening sockets the core handed it with aiohttp, as the
core's own frontend serves the port with ``http.workers: 0``: the same
connection protocol (each request stamped when its first bytes arrive:
:class:`~aserve.frontends.http.app.StampingServer`), the same
:class:`~aserve.frontends.http.limits.ConnectionGuard` (``http.header_timeout_s``,
``limits.max_pending_connections`` and ``limits.max_connections``, here per
frontend process), the same keep-alive timeout and TLS. Every request goes
to the core through :class:`~.proxy.CoreProxy`.

Its drain is the core's (:mod:`aserve.frontends.http.drain`): the connections
already in the listen backlog are taken and served, the listeners close,
every answer from then on says ``Connection: close``, idle connections close,
and it returns once none is left or its time is up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Any

from aiohttp import web

from aserve.config import HttpConfig, TlsConfig
from aserve.frontends.auth import ApiKeys
from aserve.frontends.http.app import StampingServer
from aserve.frontends.http.auth import server_ssl_context
from aserve.frontends.http.drain import take_queued, wait_connections_closed
from aserve.frontends.http.limits import ConnectionGuard, accept_error_handler, pending_bound
from aserve.frontends.proc.fast_infer import FastInfer
from aserve.frontends.proc.proxy import CoreProxy
from aserve.frontends.proc.rings import RingFds
from aserve.frontends.proc.wire import FRONTEND_HEADER
from aserve.obs.fd_limit import fds_in_use, open_file_limit

log = logging.getLogger("aserve.http.frontend")

_CUT_OFF_S = 2.0  # what still runs when the runner stops gets this long


class Frontend:
    """The aiohttp server of one frontend process over ``sockets``."""

    def __init__(
        self,
        settings: dict[str, Any],
        sockets: list[socket.socket],
        rings: tuple[RingFds, RingFds] | None,
        keys: ApiKeys | None = None,
    ) -> None:
        http = HttpConfig.model_validate(settings["http"])
        self._http = http
        self._settings = settings
        self._sockets = sockets
        self._proxy = CoreProxy(settings["core_socket"], http.keepalive_timeout_s)
        # The fast path reads bodies whole, up to the limit (it checks Content-Length first).
        self._app = web.Application(client_max_size=settings["max_request_bytes"])
        self._fast: FastInfer | None = None
        router = self._app.router
        if rings is not None:
            self._fast = FastInfer(self._proxy, *rings, settings, keys)
            for path in ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer"):
                router.add_route("POST", path, self._fast.infer)
        router.add_route("*", "/{tail:.*}", self._proxy.forward)
        self._app.on_response_prepare.append(self._on_response_prepare)
        self._runner = web.AppRunner(
            self._app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,  # a client gone cancels its forward, and so the core's
            shutdown_timeout=_CUT_OFF_S,
            auto_decompress=False,  # the body goes to the core as the client sent it
            keepalive_timeout=http.keepalive_timeout_s,
        )
        self._sites: list[web.SockSite] = []
        self._ssl_context: Any = None
        self._closing = False
        self._pid = str(os.getpid())
        # Refusals by reason (ConnectionGuard's), which the core adds to its /metrics.
        self.rejected: dict[str, int] = {}

    async def start(self) -> None:
        await self._proxy.start()
        if self._fast is not None:
            self._fast.start()
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        server.__class__ = StampingServer  # each request stamped when its first bytes arrive
        fd_limit, in_use = open_file_limit(), fds_in_use()
        guard = ConnectionGuard(
            header_timeout_s=self._http.header_timeout_s,
            max_pending=pending_bound(self._settings["max_pending_connections"], fd_limit, in_use),
            max_serving=self._settings["max_connections"],
            rejected=self.rejected,
            fd_limit=fd_limit,
            fds_in_use=in_use,
        )
        guard.install(server)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(accept_error_handler(loop.get_exception_handler()))
        tls = self._settings["tls"]
        if tls is not None:
            base_dir = Path(self._settings["base_dir"])
            self._ssl_context = server_ssl_context(TlsConfig.model_validate(tls), base_dir)
        for sock in self._sockets:
            site = web.SockSite(self._runner, sock, ssl_context=self._ssl_context)
            await site.start()
            self._sites.append(site)

    async def _on_response_prepare(self, request: web.Request, response: Any) -> None:
        response.headers[FRONTEND_HEADER] = self._pid
        if self._closing:
            response.force_close()
            response.headers["Connection"] = "close"

    async def close_listeners(self) -> None:
        """Stop accepting; serve what the backlog held; every answer closes from now on."""
        self._closing = True
        queued: list[socket.socket] = []
        for site in self._sites:
            listener = site._server
            if listener is not None:
                queued.extend(c for s in listener.sockets for c in take_queued(s))
            await site.stop()
        self._sites = []
        for sock in self._sockets:
            sock.close()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        for conn in queued:
            try:
                await loop.connect_accepted_socket(server, conn, ssl=self._ssl_context)
            except OSError:
                conn.close()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no connection is left (idle ones closed); False past ``timeout_s``."""
        server = self._runner.server
        if server is None:
            return True
        return await wait_connections_closed(server, timeout_s)

    async def stop(self) -> None:
        self._closing = True
        await self._runner.cleanup()
        if self._fast is not None:
            self._fast.stop()
        await self._proxy.close()
