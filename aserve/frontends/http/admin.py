"""HTTP routes that change or report what is served (frontends layer, on the loop).

- ``GET /v2/config/status``: the config in force (its hash), the last reload
  and its result, the last error, settings waiting for a restart, reload
  counters, and every model's state.
- Triton's model repository extension: ``POST /v2/repository/index``,
  ``POST /v2/repository/models/{m}/load`` and ``.../unload``. Models are those
  of the config file; load (re)loads a model as the file describes it (an
  ``.aserve`` archive read again: replaced in place, its new content is
  served), or as a config override says (``{"parameters": {"config": "<JSON
  text>"}}``, :mod:`aserve.frontends.load_override`); unload takes it out of
  routing until it is loaded again.

The work is done by :class:`aserve.loop.reload.Reloader`. Frontends layer, on the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from aserve.codecs.v2 import json_object
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.http.kit import RouteKit, error_response, json_response
from aserve.frontends.load_override import refuse_override_files, repository_load

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext


def add_admin_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    reloader = ctx.reloader
    read_body = kit.read_body

    async def _body(request: web.Request) -> dict[str, Any]:
        """The request's JSON object; an empty body is ``{}``."""
        return _json_object(await read_body(request))

    async def config_status(request: web.Request) -> web.Response:
        return json_response(reloader.status.as_dict(reloader.index()))

    async def repository_index(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgument("field 'ready' must be true or false")
        except AserveError as exc:
            return error_response(exc)
        return json_response(reloader.index(ready_only=ready))

    async def load(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            params = body.get("parameters") or {}
            refuse_override_files(params)
            config = params.get("config")
            if config is not None and not isinstance(config, str):
                raise InvalidArgument(
                    "parameter 'config' must be a string: the model's config as JSON text"
                )
            await repository_load(ctx, request.match_info["model"], config)
        except AserveError as exc:
            return error_response(exc)
        return web.Response(status=200)

    async def unload(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            dependents = (body.get("parameters") or {}).get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidArgument("parameter 'unload_dependents' must be true or false")
            await reloader.unload_model(request.match_info["model"], dependents)
        except AserveError as exc:
            return error_response(exc)
        return web.Response(status=200)

    kit.route("GET", "/v2/config/status", config_status)
    kit.route("POST", "/v2/repository/index", repository_index)
    kit.route("POST", "/v2/repository/models/{model}/load", load)
    kit.route("POST", "/v2/repository/models/{model}/unload", unload)


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    doc = json_object(raw)
    params = doc.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgument("field 'parameters' must be an object")
    return doc
