"""What the HTTP app hands its route modules, and the V2 answers they share
(frontends layer; on the loop).

Route modules (generate, openai, predictions, admin, dashboard, metrics,
openapi) never import the app (:mod:`aserve.frontends.http.app`): it calls
their ``add_*_routes(kit, ctx)`` with a :class:`RouteKit` of its own
functions, and they find the server's state in the
:class:`~aserve.frontends.context.FrontendContext`.

An inference handler stores the runtime that serves it in
``request[RUNTIME_KEY]`` (what it is counted under); a streamed response that
failed after its first byte says so in ``request[STATUS_KEY]``, since its HTTP
status was already 200. Every request comes with ``request[ARRIVAL_KEY]``, the
time its first bytes were read, for ``Runtime.infer``'s ``arrival``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from aserve.errors import AserveError, ErrorCode
from aserve.frontends.common import Route
from aserve.frontends.http.bodies import SpooledBody
from aserve.frontends.status import HTTP_STATUS

RUNTIME_KEY: Final = web.RequestKey("aserve_runtime", object)  # the runtime that served it
STATUS_KEY: Final = web.RequestKey("aserve_status", str)  # a failed stream's error code
# The request's id, on the request (SSE sends its headers early).
REQUEST_ID_KEY: Final = web.RequestKey("aserve_request_id", str)
# On a request: its connection closes after the answer.
CLOSE_AFTER_KEY: Final = web.RequestKey("aserve_close_after", bool)
# On every request: the time.monotonic() its first bytes were read, which its
# deadline counts from (set by the app's connection protocol).
ARRIVAL_KEY: Final = web.RequestKey("aserve_arrival", float)
JSON: Final = "application/json"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refuse = Callable[[AserveError], web.StreamResponse]


@dataclass(frozen=True, slots=True)
class RouteKit:
    route: Route  # route(method, path, handler); other methods answer 405
    # counted(protocol, handler, refuse): ``handler`` admitted under
    # limits.max_concurrency (a refusal answered by ``refuse``, the route's own
    # error format) and counted under ``protocol`` once answered.
    counted: Callable[[str, Handler, Refuse], Handler]
    # The whole body, inflated, bounded by limits.max_request_bytes.
    read_body: Callable[[web.Request], Awaitable[bytes]]
    # read_json(request, limit_bytes): the body as a JSON object.
    read_json: Callable[[web.Request, int | None], Awaitable[dict[str, Any]]]
    app: web.Application  # for routes that need its lifetime (cleanup_ctx)
    # read_body, but a big body is handed over in its temporary file (bodies).
    read_body_spooled: Callable[[web.Request], Awaitable[bytes | SpooledBody]]


def error_response(error: AserveError) -> web.Response:
    """A V2 error answer: ``{"error": "..."}`` with the error's HTTP status."""
    status = HTTP_STATUS[error.code]
    headers = {"Retry-After": "1"} if error.code is ErrorCode.QUEUE_FULL else None
    return web.Response(
        status=status,
        body=orjson.dumps({"error": error.message}),
        content_type=JSON,
        headers=headers,
    )


def json_response(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type=JSON)
