"""Triton's shared memory extensions over HTTP (frontends layer; handlers on the loop).

System shared memory (:class:`aserve.frontends.shm_regions.SystemSharedMemory`):

- ``GET /v2/systemsharedmemory[/region/{name}]/status``: a JSON array of
  ``{"name", "key", "offset", "byte_size"}``, every region or the one named;
- ``POST /v2/systemsharedmemory/region/{name}/register``, body
  ``{"key", "offset", "byte_size"}`` (what tritonclient's
  ``register_system_shared_memory`` sends); 200 with an empty body;
- ``POST /v2/systemsharedmemory[/region/{name}]/unregister``: the one named,
  or every region.

CUDA shared memory (``/v2/cudasharedmemory/...``, the same routes): this
server maps no GPU memory, so status lists nothing, register answers 400 and
unregister has nothing to do. The routes need an admin key when keys are on
(:mod:`aserve.frontends.roles`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from aserve.codecs.v2 import json_object
from aserve.errors import AserveError, InvalidArgument
from aserve.frontends.http.kit import RouteKit, error_response, json_response
from aserve.frontends.shm_regions import NO_GPU

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext

SYSTEM: Final = "/v2/systemsharedmemory"
CUDA: Final = "/v2/cudasharedmemory"


def add_shared_memory_routes(kit: RouteKit, ctx: FrontendContext) -> None:
    regions = ctx.shared_memory
    read_body = kit.read_body

    async def status(request: web.Request) -> web.Response:
        try:
            return json_response(regions.status(request.match_info.get("name", "")))
        except AserveError as exc:
            return error_response(exc)

    async def register(request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
            doc = json_object(body) if body.strip() else {}
            regions.register(
                request.match_info["name"],
                _field(doc, "key"),
                doc.get("offset", 0),
                _field(doc, "byte_size"),
            )
        except AserveError as exc:
            return error_response(exc)
        return web.Response(status=200)

    async def unregister(request: web.Request) -> web.Response:
        regions.unregister(request.match_info.get("name", ""))
        return web.Response(status=200)

    async def cuda_status(request: web.Request) -> web.Response:
        name = request.match_info.get("name")
        if name:
            return error_response(
                InvalidArgument(f"Unable to find cuda shared memory region: '{name}'")
            )
        return json_response([])

    async def cuda_register(request: web.Request) -> web.Response:
        return error_response(InvalidArgument(NO_GPU))

    async def cuda_unregister(request: web.Request) -> web.Response:
        return web.Response(status=200)  # nothing is ever registered

    for base, on_status, on_register, on_unregister in (
        (SYSTEM, status, register, unregister),
        (CUDA, cuda_status, cuda_register, cuda_unregister),
    ):
        kit.route("GET", base + "/status", on_status)
        kit.route("GET", base + "/region/{name}/status", on_status)
        kit.route("POST", base + "/region/{name}/register", on_register)
        kit.route("POST", base + "/unregister", on_unregister)
        kit.route("POST", base + "/region/{name}/unregister", on_unregister)


def _field(doc: dict[str, Any], name: str) -> Any:
    if name not in doc:
        raise InvalidArgument(f"register: field '{name}' is required")
    return doc[name]
