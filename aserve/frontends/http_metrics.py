"""``GET /metrics`` and the admission and counting of the HTTP inference routes (on the loop).

:func:`inference_route` wraps an inference handler: it enters the server's
admission (``limits.max_concurrency``) for as long as the handler runs, and
when it returns (or is cancelled because the client went away) one request
is counted under the runtime the handler stored in ``request[RUNTIME_KEY]``
and the status its response says.
A streamed response that failed after its first byte says so in
``request[STATUS_KEY]``, since its HTTP status was already 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from aserve.errors import AserveError, ErrorCode
from aserve.frontends.status import STATUS
from aserve.logs import CURRENT, REQUEST_ID_HEADER, REQUEST_ID_KEY, RequestInfo, request_id
from aserve.metrics import OK

if TYPE_CHECKING:
    from aserve.loop.runtime import Server

RUNTIME_KEY: Final = "aserve_runtime"  # the runtime that served the request
STATUS_KEY: Final = "aserve_status"  # a streamed request's error code, once it failed

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = Callable[[str, str, Any], None]

# HTTP status -> the status label (the error code's value; "ok" for 200).
_LABELS: Final[dict[int, str]] = {200: OK, **{s.http: code.value for code, s in STATUS.items()}}


def status_label(http_status: int) -> str:
    label = _LABELS.get(http_status)
    if label is not None:
        return label
    if http_status < 400:
        return OK
    return (ErrorCode.INTERNAL if http_status >= 500 else ErrorCode.INVALID_ARGUMENT).value


def inference_route(
    server: Server,
    protocol: str,
    handler: _Handler,
    refuse: Callable[[AserveError], web.StreamResponse],
) -> _Handler:
    """``handler`` as an inference route: admitted under ``limits.max_concurrency``
    (a refusal is answered by ``refuse``, the route's own error format) and
    counted under ``protocol`` once answered."""
    requests = server.metrics.requests
    admission = server.admission

    async def counting(request: web.Request) -> web.StreamResponse:
        started = perf_counter()
        rid = request[REQUEST_ID_KEY] = request_id(request.headers.get(REQUEST_ID_HEADER))
        if requests.access_log:  # nothing else reads it: no work per request without the log
            # This handler runs in its own task: the variable is this request's alone.
            CURRENT.set(RequestInfo(rid))
        try:
            with admission:
                response = await handler(request)
        except asyncio.CancelledError:
            requests.record(request.get(RUNTIME_KEY), protocol, ErrorCode.CANCELLED.value, started)
            raise
        except AserveError as exc:  # refused by the admission
            requests.record(None, protocol, exc.code.value, started)
            response = refuse(exc)
            response.headers[REQUEST_ID_HEADER] = rid
            return response
        except Exception:
            requests.record(request.get(RUNTIME_KEY), protocol, ErrorCode.INTERNAL.value, started)
            raise
        status = request.get(STATUS_KEY) or status_label(response.status)
        requests.record(request.get(RUNTIME_KEY), protocol, status, started)
        if not response.prepared:  # a stream sent its headers, the id among them, already
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    counting.__name__ = getattr(handler, "__name__", "handler")
    return counting


def add_metrics_route(route: Route, server: Server) -> None:
    registry = server.metrics.registry

    async def metrics(request: web.Request) -> web.Response:
        # Prometheus text 0.0.4, or OpenMetrics when the scraper asks for it.
        # Built on the loop: the collector reads loop-owned counters, and a
        # scrape of a few models costs well under a millisecond.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    route("GET", "/metrics", metrics)
