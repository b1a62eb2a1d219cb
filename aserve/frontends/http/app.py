"""The aiohttp frontend: its application, listeners and drain, and KServe V2 REST
with the binary tensor extension (frontends layer; handlers run on the loop).

The infer handler decodes and validates the body, hands the request to the
model's runtime (``Runtime.infer``) and awaits its future; when the
client disconnects, aiohttp cancels the handler and the request leaves the
queue. Every error answers ``{"error": "..."}`` with the status from
:data:`HTTP_STATUS`. The other route modules (generate, openai, predictions,
admin, dashboard, metrics, openapi) are registered here and are handed what
they need, a :class:`~aserve.frontends.http.kit.RouteKit` of this module's
functions and the :class:`~aserve.frontends.context.FrontendContext`: they never
import this module.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import logging
import zlib
from collections import deque
from time import monotonic
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from aserve import __version__
from aserve.codecs.timeouts import header_timeout_s
from aserve.codecs.v2 import decode_request, encode_response, json_object
from aserve.codecs.validate import same_io
from aserve.errors import AserveError, InvalidArgument, RequestTimeout, TooLarge, Unavailable
from aserve.frontends.common import (
    TIMEOUT_HEADER,
    admit_and_count,
    model_listing,
    model_metadata,
    request_id,
    resolve_deadline,
)
from aserve.frontends.http.admin import add_admin_routes
from aserve.frontends.http.auth import http_middleware, server_ssl_context
from aserve.frontends.http.bodies import BodyBudget, SpooledBody, read_back, read_spooled
from aserve.frontends.http.dashboard import add_dashboard_routes
from aserve.frontends.http.drain import take_queued, wait_connections_closed
from aserve.frontends.http.embeddings import add_embedding_routes
from aserve.frontends.http.generate import add_generate_routes
from aserve.frontends.http.kit import (
    ARRIVAL_KEY,
    CLOSE_AFTER_KEY,
    JSON,
    REQUEST_ID_KEY,
    RUNTIME_KEY,
    STATUS_KEY,
    Handler,
    Refuse,
    RouteKit,
    error_response,
    json_response,
)
from aserve.frontends.http.limits import (
    REFUSED_STATUSES,
    ConnectionGuard,
    accept_error_handler,
    pending_bound,
)
from aserve.frontends.http.metrics import add_metrics_route
from aserve.frontends.http.openai import add_openai_routes
from aserve.frontends.http.openapi import add_openapi_route
from aserve.frontends.http.predictions import add_prediction_routes
from aserve.frontends.http.shared_memory import add_shared_memory_routes
from aserve.frontends.model_config import triton_config_json
from aserve.frontends.proc.pool import BehindFrontends
from aserve.frontends.proc.wire import ARRIVAL_HEADER, FORWARDED_FOR_HEADER
from aserve.frontends.status import STATUS_LABELS, status_label
from aserve.loop.prompt_size import BODY_BYTES_PER_PROMPT_BYTE, BODY_SLACK_BYTES
from aserve.obs.fd_limit import fds_in_use, open_file_limit
from aserve.obs.frontend_metrics import FrontendCollector
from aserve.obs.logs import CURRENT, REQUEST_ID_HEADER, RequestInfo

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.loop.runtimes.base import Runtime

log = logging.getLogger("aserve.http")

IHCL = "Inference-Header-Content-Length"
_COMPRESS_OVER_BYTES = 64 * 1024  # larger bodies are compressed off the loop
# Request bodies aserve inflates itself (see read_body); the zlib window bits of each.
_INFLATE_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
# Deflate inflates at most ~1032x: a body past a kilobyte may inflate to megabytes
# (up to max_request_bytes), so it is inflated on a thread (zlib releases the GIL).
_INFLATE_ON_LOOP_BYTES = 1024
# After drain_timeout_s, what is still running gets this long to answer (a
# generation stream its final error event) before it is cancelled.
CUT_OFF_S = 2.0
MAX_BODY_KEY = web.AppKey("aserve_max_request_bytes", int)
BODY_BUDGET_KEY = web.AppKey("aserve_body_budget", BodyBudget)
BODY_TIMEOUT_KEY = web.AppKey("aserve_body_timeout_s", float)

_json = json_response


# --- when each request arrived --------------------------------------------------
#
# A request's deadline counts from when its first bytes were read (docs/guide/batching.md,
# "A request's deadline"), not from when its handler runs: in a retry
# storm the wait between the two (the loop's backlog, the requests ahead on a
# pipelined connection, a body still arriving) was what made admitted requests
# late. aiohttp keeps no such time, and has no setting for its protocol's class,
# so the server's protocol is aiohttp's own, its data_received noting the time.

_parse = RequestHandler.data_received  # called directly: no super() object per chunk


class _StampingHandler(RequestHandler):
    """aiohttp's protocol of one connection that also notes when each request's
    first bytes were read (``time.monotonic()``), as ``request[ARRIVAL_KEY]`` of
    the request it makes: one float per request.

    A request's first bytes are its head's: the first chunk of a head read in
    several, or the chunk that holds it when the bytes before it in that chunk
    end the body of the request before (a pipelined request). Where a chunk
    cannot tell (the rest of a body, then a head that goes on in the next
    chunk), the later time is taken: a stamp may be late, as every stamp was
    before, but never early, so no request is refused for time it did not spend.
    """

    __slots__ = ("_body", "_first", "_head_since", "_made", "_make", "_stamps")

    def __init__(self, manager: Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        # The stamps of the requests parsed and not made yet, in order; _first is
        # the connection's count (aiohttp's _request_count) of the first of them.
        self._stamps: deque[float] = deque()
        self._first = 1
        self._made = 0  # requests made on this connection
        self._head_since: float | None = None  # when a head not complete yet began
        self._body: Any = None  # the payload of the last head parsed
        self._make = self._request_factory
        # A plain function, handed this protocol: a bound method would be a cycle.
        self._request_factory = _StampingHandler._stamped

    def data_received(self, data: bytes) -> None:
        now = monotonic()
        body = self._body
        # With the last body complete, these bytes begin a head or go on with one;
        # else they go on with that body, and a head they hold begins in them.
        between = body is None or body.is_eof()
        since = self._head_since if between and self._head_since is not None else now
        before = self._request_count
        _parse(self, data)
        parsed = self._request_count - before
        if parsed:
            stamps = self._stamps
            if not stamps:
                self._first = before + 1
            stamps.append(since)
            for _ in range(parsed - 1):  # pipelined behind the first, in this chunk
                stamps.append(now)
            self._body = self._messages[-1][1]
            self._head_since = None
        elif between and data:
            self._head_since = since

    @staticmethod
    def _stamped(
        message: Any, payload: Any, protocol: _StampingHandler, writer: Any, task: Any
    ) -> web.BaseRequest:
        """aiohttp's request factory, the request given its stamp (the next, in order)."""
        request = protocol._make(message, payload, protocol, writer, task)
        made = protocol._made = protocol._made + 1
        stamps = protocol._stamps
        if stamps and protocol._first == made:
            protocol._first = made + 1
            request[ARRIVAL_KEY] = stamps.popleft()
        else:  # parsed where data_received did not see it (behind a declined upgrade)
            request[ARRIVAL_KEY] = monotonic()
        return request


class StampingServer(Server):
    """aiohttp's server, its connections' protocol :class:`_StampingHandler` (the
    frontend processes of ``http.workers`` serve their clients with it too)."""

    def __call__(self) -> RequestHandler:
        return _StampingHandler(self, loop=self._loop, **self._kwargs)


class _ForwardedHandler(_StampingHandler):
    """The core's protocol on its private Unix socket behind ``http.workers``: a
    request's arrival and its client's address are the ones the frontend process
    that forwarded it noted (:mod:`aserve.frontends.proc.wire`). Only frontends
    reach that socket (a folder of mode 0700), so the headers are trusted here
    and nowhere else."""

    __slots__ = ()

    def __init__(self, manager: Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._request_factory = _ForwardedHandler._forwarded

    @staticmethod
    def _forwarded(
        message: Any, payload: Any, protocol: _StampingHandler, writer: Any, task: Any
    ) -> web.BaseRequest:
        request = _StampingHandler._stamped(message, payload, protocol, writer, task)
        headers = message.headers
        stamp = headers.get(ARRIVAL_HEADER)
        if stamp is not None:
            try:
                arrival = float(stamp)
            except ValueError:
                arrival = None
            # Taken when not later than the core's own stamp (the frontend read the bytes first).
            if arrival is not None and arrival <= request[ARRIVAL_KEY]:
                request[ARRIVAL_KEY] = arrival
        remote = headers.get(FORWARDED_FOR_HEADER)
        if remote:
            request._cache["remote"] = remote  # what `request.remote` (a reify) answers
        return request


class _ForwardedServer(Server):
    """aiohttp's server, its connections' protocol :class:`_ForwardedHandler`."""

    def __call__(self) -> RequestHandler:
        return _ForwardedHandler(self, loop=self._loop, **self._kwargs)


class HttpFrontend:
    def __init__(self, ctx: FrontendContext) -> None:
        self._ctx = ctx
        cfg = ctx.config
        self._max_body = cfg.limits.max_request_bytes
        self._max_elements = cfg.limits.max_tensor_elements
        self._max_timeout_s = cfg.limits.max_timeout_ms / 1e3
        middlewares = []
        if ctx.api_keys is not None:
            assert cfg.auth is not None
            middlewares.append(http_middleware(ctx.api_keys, cfg.auth.open_paths))
        self._app = web.Application(client_max_size=self._max_body, middlewares=middlewares)
        self._app[MAX_BODY_KEY] = self._max_body
        self._app[BODY_BUDGET_KEY] = BodyBudget(
            cfg.limits.inflight_bytes_limit, ctx.metrics.requests.rejected
        )
        self._app[BODY_TIMEOUT_KEY] = cfg.http.body_timeout_s
        self._app.on_response_prepare.append(self._on_response_prepare)
        self._add_routes()
        self._runner = web.AppRunner(
            self._app,
            handle_signals=False,
            access_log=None,  # per-request logging costs more than a tiny model
            handler_cancellation=True,  # a client that goes away cancels its handler
            # drain() has waited for the requests in flight already.
            shutdown_timeout=CUT_OFF_S,
            auto_decompress=False,  # read_body inflates: errors answer JSON, the limit holds
            # An idle connection is closed after this; a connection that has not
            # sent its first request yet, much sooner (ConnectionGuard).
            keepalive_timeout=cfg.http.keepalive_timeout_s,
        )
        self._site: web.TCPSite | None = None
        self._ssl_context: Any = None
        self._closing = False  # the listeners are closed: answers say Connection: close
        self.connections: ConnectionGuard | None = None
        self.addresses: list[tuple[str, int]] = []
        self._frontends: BehindFrontends | None = None  # http.workers > 0

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        cfg = self._ctx.config.http
        await self._runner.setup()
        limits = self._ctx.config.limits
        fd_limit, in_use = open_file_limit(), fds_in_use()
        self.connections = ConnectionGuard(
            header_timeout_s=cfg.header_timeout_s,
            max_pending=pending_bound(limits.max_pending_connections, fd_limit, in_use),
            # Behind frontend processes each of them bounds its clients' connections.
            max_serving=None if cfg.workers else limits.max_connections,
            rejected=self._ctx.metrics.requests.rejected,
            fd_limit=fd_limit,
            fds_in_use=in_use,
        )
        assert self._runner.server is not None
        # aiohttp's server makes each connection's protocol in __call__: this one's
        # are to note when each request arrived (_StampingHandler).
        behind = cfg.workers > 0  # frontend processes serve the port, the core a private socket
        self._runner.server.__class__ = _ForwardedServer if behind else StampingServer
        self.connections.install(self._runner.server)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(accept_error_handler(loop.get_exception_handler()))
        tls = self._ctx.config.tls
        ssl_context = None if tls is None else server_ssl_context(tls, self._ctx.base_dir)
        self._ssl_context = ssl_context
        if behind:
            self._frontends = BehindFrontends(self._ctx, CUT_OFF_S)
            self.addresses = await self._frontends.start(self._runner)
            self._ctx.metrics.registry.register(FrontendCollector(self._frontends.snapshot))
        else:
            self._site = web.TCPSite(
                self._runner, cfg.host, cfg.port, reuse_address=True, ssl_context=ssl_context
            )
            await self._site.start()
            server = self._site._server
            assert server is not None
            self.addresses = [s.getsockname()[:2] for s in server.sockets]  # type: ignore[attr-defined]
        for host, port in self.addresses:
            scheme = "http" if ssl_context is None else "https"
            log.info("HTTP (KServe V2 REST) listening on %s://%s:%d", scheme, host, port)

    @property
    def dashboard_url(self) -> str:
        """Where the dashboard is (the first address bound), as the startup log names it."""
        host, port = self.addresses[0]
        if host in ("0.0.0.0", "::"):  # every interface: this machine's own name reaches it
            host = "localhost"
        elif ":" in host:
            host = f"[{host}]"
        return f"{'http' if self._ssl_context is None else 'https'}://{host}:{port}/"

    async def close_listeners(self) -> None:
        """Stop accepting; from now on every answer closes its connection.

        The connections already queued in the listen backlog are accepted and
        served first: their clients may have sent a request (see http_drain).
        """
        if self._frontends is not None:  # they stop accepting; the core serves them on
            self._frontends.close_listeners()
            return
        self._closing = True
        site = self._site
        if site is None:
            return
        listener = site._server
        queued = [] if listener is None else [c for s in listener.sockets for c in take_queued(s)]
        await site.stop()  # closes the listening sockets before its first await
        self._site = None
        if queued:
            await asyncio.gather(*(self._serve_accepted(sock) for sock in queued))

    async def _serve_accepted(self, sock: Any) -> None:
        assert self._runner.server is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self._runner.server, sock, ssl=self._ssl_context)
        except OSError:
            sock.close()  # the client left meanwhile, or its TLS handshake failed

    async def drain(self, timeout_s: float) -> bool:
        """After :meth:`close_listeners`: wait until every connection has closed,
        closing idle ones when no client can be sending on them. False when
        ``timeout_s`` passed first."""
        server = self._runner.server
        if server is None:
            return True
        if self._frontends is not None:  # their connections to the core close as they exit
            return await self._frontends.drain(timeout_s)
        return await wait_connections_closed(server, timeout_s)

    async def stop(self) -> None:
        """Close what is left: requests still running get ``CUT_OFF_S`` to answer."""
        self._closing = True
        if self._frontends is not None:
            await self._frontends.stop(CUT_OFF_S)  # before the core's app: they may still ask
        await self._runner.cleanup()
        if self._frontends is not None:
            self._frontends.remove()

    async def _on_response_prepare(self, request: web.Request, response: Any) -> None:
        if self._closing or request.get(CLOSE_AFTER_KEY):
            response.force_close()  # aiohttp closes the connection after this answer
            response.headers["Connection"] = "close"  # headers are made before this hook runs

    # --- routes ---------------------------------------------------------------

    def _add_routes(self) -> None:
        r = self._app.router
        model = "/v2/models/{model}"
        version = "/v2/models/{model}/versions/{version}"
        ctx = self._ctx

        def route(method: str, path: str, handler: Any) -> None:
            resource = r.add_resource(path)
            resource.add_route(method, handler)
            resource.add_route("*", self._method_not_allowed)

        route("GET", "/v2/health/live", self._live)
        route("GET", "/v2/health/ready", self._ready)
        route("GET", "/v2", self._server_metadata)
        route("GET", "/v2/", self._server_metadata)
        route("GET", "/v2/models", self._models)
        route("GET", "/v2/models/stats", self._stats)
        # Every route under /v2/models/{model} is tried in the order added: infer,
        # the one that carries the load, first.
        infer = self.counted("http", self._infer, error_response)
        for base in (model, version):
            route("POST", base + "/infer", infer)
        for base in (model, version):
            route("GET", base, self._model_metadata)
            route("GET", base + "/config", self._model_config)
            route("GET", base + "/ready", self._model_ready)
            route("GET", base + "/stats", self._stats)
        kit = RouteKit(
            route, self.counted, read_body, read_json_object, self._app, read_body_spooled
        )
        add_generate_routes(kit, ctx)  # Triton's generate extension
        add_openai_routes(kit, ctx)
        add_embedding_routes(kit, ctx)  # OpenAI's /v1/embeddings
        add_admin_routes(kit, ctx)
        add_shared_memory_routes(kit, ctx)  # Triton's shared memory extensions
        add_prediction_routes(kit, ctx)
        add_metrics_route(kit, ctx)
        add_openapi_route(kit)
        add_dashboard_routes(kit, ctx)
        r.add_route("*", "/{tail:.*}", self._not_found)

    def counted(self, protocol: str, handler: Handler, refuse: Refuse) -> Handler:
        """``handler`` as an inference route: admitted under ``limits.max_concurrency``
        (a refusal is answered by ``refuse``, the route's own error format) and
        counted under ``protocol`` once answered (:class:`admit_and_count`)."""
        ctx = self._ctx
        access_log = ctx.metrics.requests.access_log

        async def counting(request: web.Request) -> web.StreamResponse:
            rid = request[REQUEST_ID_KEY] = request_id(request.headers.get(REQUEST_ID_HEADER))
            if access_log:  # nothing else reads it: no work per request without the log
                # This handler runs in its own task: the variable is this request's alone.
                CURRENT.set(RequestInfo(rid))
            try:
                # partial(request.get, ...) is C: the runtime the handler stored, if any.
                with admit_and_count(
                    ctx, protocol, functools.partial(request.get, RUNTIME_KEY)
                ) as call:
                    response = await handler(request)
                    call.status = (
                        request.get(STATUS_KEY)
                        or STATUS_LABELS.get(response.status)
                        or status_label(response.status)
                    )
            except AserveError as exc:  # refused by the admission
                response = refuse(exc)
            if not response.prepared:  # a stream sent its headers, the id among them, already
                response.headers[REQUEST_ID_HEADER] = rid
            # Refusals in a row on one connection are paced while the loop lags
            # (ConnectionGuard.refusal_hold), after the request has left the
            # admission: a held refusal holds no slot.
            guard = self.connections
            if guard is not None:
                if response.status in REFUSED_STATUSES and not response.prepared:
                    hold = guard.refusal_hold(request.protocol, _budget_s(request))
                    if hold:
                        await asyncio.sleep(hold)
                elif guard.refused_in_a_row and request.protocol in guard.refused_in_a_row:
                    guard.served(request.protocol)
            return response

        counting.__name__ = getattr(handler, "__name__", "handler")
        return counting

    async def _method_not_allowed(self, request: web.Request) -> web.Response:
        return _json({"error": f"method {request.method} is not allowed on {request.path}"}, 405)

    async def _not_found(self, request: web.Request) -> web.Response:
        return _json({"error": f"no such endpoint: {request.method} {request.path}"}, 404)

    def _runtime(self, request: web.Request) -> Runtime:
        info = request.match_info
        return self._ctx.registry.get(info["model"], info.get("version"))

    # --- health and metadata --------------------------------------------------

    async def _live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        reason = self._ctx.not_ready_reason()
        if reason:
            return _json({"ready": False, "error": reason}, 503)
        return _json({"ready": True})

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return _json(
            {
                "name": "aserve",
                "version": __version__,
                "extensions": [
                    "binary_tensor_data",
                    "parameters",
                    "statistics",
                    "model_repository",
                    "model_configuration",
                    "system_shared_memory",
                ],
            }
        )

    async def _model_metadata(self, request: web.Request) -> web.Response:
        try:
            return _json(model_metadata(self._ctx.registry, self._runtime(request)))
        except AserveError as exc:
            return error_response(exc)

    async def _models(self, request: web.Request) -> web.Response:
        return _json({"models": model_listing(self._ctx.registry)})

    async def _model_config(self, request: web.Request) -> web.Response:
        try:
            return _json(triton_config_json(self._runtime(request).triton_config()))
        except AserveError as exc:
            return error_response(exc)

    async def _model_ready(self, request: web.Request) -> web.Response:
        try:
            runtime = self._runtime(request)
        except AserveError as exc:
            return error_response(exc)
        reason = runtime.not_ready_reason()
        if reason is not None:
            return error_response(Unavailable(reason))
        return _json({"name": runtime.name, "ready": True})

    async def _stats(self, request: web.Request) -> web.Response:
        try:
            if "model" in request.match_info:
                runtimes = [self._runtime(request)]
            else:
                runtimes = sorted(self._ctx.registry, key=lambda rt: (rt.name, int(rt.version)))
        except AserveError as exc:
            return error_response(exc)
        return _json({"model_stats": [rt.statistics() for rt in runtimes]})

    # --- inference ------------------------------------------------------------

    async def _infer(self, request: web.Request) -> web.Response:
        try:
            return await self._infer_checked(request)
        except AserveError as exc:
            return error_response(exc)

    async def _infer_checked(self, request: web.Request) -> web.Response:
        length = request.content_length
        if length is not None and length > self._max_body:
            raise TooLarge(
                f"request body is {length} bytes, over the limit max_request_bytes {self._max_body}"
            )
        body = await read_body(request)
        # Routing is looked up only now, with no await from here to the submit
        # (but the decoding of large tensors, after which it is looked up again):
        # a runtime a reload takes out of routing is drained once its queue is
        # empty, so a request must not hold one across an await before queueing.
        runtime = self._runtime(request)
        request[RUNTIME_KEY] = runtime
        headers = request.headers
        decoded = decode_request(
            body,
            headers.get(IHCL),
            runtime.name,
            runtime.input_specs,
            runtime.output_specs,
            runtime.max_batch_size,
            runtime.variable_shapes,
            max_elements=self._max_elements,
            defer=True,
            shm=self._ctx.shared_memory,
        )
        try:
            if decoded.pending:  # much data: decoded on a thread, then routing is looked up again
                await asyncio.to_thread(decoded.decode_pending)
                runtime = same_io(runtime, self._runtime(request))
                request[RUNTIME_KEY] = runtime
            timeout = resolve_deadline(
                headers.get(TIMEOUT_HEADER),
                decoded.timeout_s,
                None,
                runtime.default_timeout_s,
                self._max_timeout_s,
            )
            outputs = await runtime.infer(
                decoded.inputs,
                decoded.batch_size,
                decoded.shape_key,
                timeout,
                decoded.client_id,
                decoded.parameters,
                arrival=request[ARRIVAL_KEY],
            )
            payload, json_length = encode_response(
                runtime.name, runtime.version, decoded, outputs, runtime.output_specs
            )
            out_headers: dict[str, str] = {}
            if json_length is not None:
                out_headers[IHCL] = str(json_length)
                content_type = "application/octet-stream"
            else:
                content_type = JSON
            encoding = _response_encoding(headers.get("Accept-Encoding"))
            if encoding is not None:
                payload = await _compress(payload, encoding)
                out_headers["Content-Encoding"] = encoding
            return web.Response(body=payload, content_type=content_type, headers=out_headers)
        finally:
            if decoded.shm_held:  # the regions it used: kept mapped until now
                decoded.release_shared_memory()


def _budget_s(request: web.Request) -> float | None:
    """A refused request's deadline budget, for pacing its refusal: its
    ``aserve-timeout-ms`` header, else its model's default (None: unknown)."""
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            return header_timeout_s(header)
        except InvalidArgument:
            return None
    runtime = request.get(RUNTIME_KEY)
    return None if runtime is None else float(runtime.default_timeout_s)


async def read_body(request: web.Request) -> bytes:
    """The whole request body, inflated as its Content-Encoding says (gzip, deflate).

    Raises :class:`TooLarge` when the body, or what it inflates to, is over
    ``limits.max_request_bytes``, and :class:`InvalidArgument` when it cannot be
    read: an unsupported encoding, data that does not inflate, a body that ends
    early. aiohttp's own decompression is off: it answers bad data with a plain
    text 400 and a closed connection, or lets ``read()`` raise (a 500).
    :class:`RequestTimeout` when it has not all arrived within ``http.body_timeout_s``
    (the connection is closed after the answer). :class:`QueueFull` (429) when
    the bodies being held would pass ``limits.max_inflight_bytes``
    (:mod:`~aserve.frontends.http.bodies`).
    """
    raw = await _received(request)
    if isinstance(raw, SpooledBody):
        # Read back whole on a thread: pread lets go of the GIL, where joining the
        # pieces of a big body in memory held it (and both copies) for its length.
        raw = await asyncio.to_thread(read_back, raw)
    encoding = _content_encoding(request)
    if encoding in ("identity", ""):
        return raw
    if encoding not in _INFLATE_WBITS:
        raise InvalidArgument(
            f"request Content-Encoding '{encoding}' is not supported (gzip, deflate, identity)"
        )
    limit = request.app[MAX_BODY_KEY]
    if len(raw) > _INFLATE_ON_LOOP_BYTES:
        body = await asyncio.to_thread(_inflate, raw, encoding, limit)
    else:
        body = _inflate(raw, encoding, limit)
    request.app[BODY_BUDGET_KEY].hold(request, len(body))
    return body


async def read_body_spooled(request: web.Request) -> bytes | SpooledBody:
    """:func:`read_body`, but a body over ``bodies.SPOOL_OVER_BYTES`` is handed over in
    its temporary file (:mod:`~aserve.frontends.http.bodies`), for the caller to read
    on a thread and close; one with a Content-Encoding is inflated in memory as
    :func:`read_body` does."""
    if _content_encoding(request) not in ("identity", ""):
        return await read_body(request)
    return await _received(request)


async def _received(request: web.Request) -> bytes | SpooledBody:
    """The body (a big one in its temporary file), within ``http.body_timeout_s``,
    bounded and counted (:mod:`~aserve.frontends.http.bodies`), errors as aserve's."""
    limit = request.app[MAX_BODY_KEY]
    timeout_s = request.app[BODY_TIMEOUT_KEY]
    try:
        if request.content.is_eof():
            # All of it has arrived with the head (a small body): reading cannot
            # wait, a timer per request is not free, and what is in memory already
            # is not counted against limits.max_inflight_bytes (bodies).
            body = await request.content.read()
            if len(body) > limit:
                raise TooLarge(f"request body is over the limit max_request_bytes {limit}")
            return body
        async with asyncio.timeout(timeout_s):
            return await read_spooled(request, request.app[BODY_BUDGET_KEY], limit)
    except TimeoutError:
        request[CLOSE_AFTER_KEY] = True  # the rest of the body may still be coming
        raise RequestTimeout(
            f"request body not received within http.body_timeout_s ({timeout_s:g} s)"
        ) from None
    except web.RequestPayloadError as exc:
        raise InvalidArgument(f"request body cannot be read: {exc}") from None


def _content_encoding(request: web.Request) -> str:
    return request.headers.get("Content-Encoding", "identity").strip().lower()


async def read_json_object(request: web.Request, limit_bytes: int | None = None) -> dict[str, Any]:
    """The request body as a JSON object, or :class:`InvalidArgument` / :class:`TooLarge`.

    A body over ``limit_bytes`` is refused before it is read (by its
    Content-Length) or parsed: parsing runs on the loop. Without
    ``limit_bytes``, ``limits.max_request_bytes`` bounds it.
    """
    declared = request.content_length
    if limit_bytes is not None and declared is not None and declared > limit_bytes:
        raise _body_too_large(declared, limit_bytes)
    body = await read_body(request)
    if limit_bytes is not None and len(body) > limit_bytes:
        raise _body_too_large(len(body), limit_bytes)
    return json_object(body)


def _body_too_large(size: int, limit: int) -> TooLarge:
    return TooLarge(
        f"request body: {size} bytes, over the limit of a generation request to this model "
        f"({limit} bytes: {BODY_BYTES_PER_PROMPT_BYTE} x generation.max_prompt_bytes "
        f"+ {BODY_SLACK_BYTES // 1024} KiB)"
    )


def _inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    wbits = _INFLATE_WBITS[encoding]
    if encoding == "deflate" and raw and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate, without the zlib header (as aiohttp accepts)
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(raw, limit + 1)  # a small bomb must not inflate unbounded
    except zlib.error as exc:
        raise InvalidArgument(f"request body cannot be read as {encoding}: {exc}") from None
    if len(body) > limit:
        raise TooLarge(f"request body inflates to over the limit max_request_bytes {limit}")
    if not inflater.eof:
        raise InvalidArgument(f"request body cannot be read as {encoding}: it ends early")
    return body


def _response_encoding(accept: str | None) -> str | None:
    # Compress only when asked for exactly one of gzip/deflate: the aio
    # tritonclient sends aiohttp's default "gzip, deflate, br" on every call
    # but does not decompress.
    if accept is None:
        return None
    value = accept.strip().lower()
    return value if value in ("gzip", "deflate") else None


async def _compress(payload: bytes, encoding: str) -> bytes:
    fn = gzip.compress if encoding == "gzip" else zlib.compress
    if len(payload) > _COMPRESS_OVER_BYTES:
        return await asyncio.to_thread(fn, payload)
    return fn(payload)
