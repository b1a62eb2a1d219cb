"""``GET /metrics``: Prometheus text, or OpenMetrics when the scraper asks (frontends layer, on the loop).

Built on the loop: the collector reads loop-owned counters, and a scrape of
a few models costs well under a millisecond. (Inference requests are
counted by :class:`aserve.frontends.common.admit_and_count`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.frontends.http.kit import RouteKit


def add_metrics_route(kit: RouteKit, ctx: FrontendContext) -> None:
    registry = ctx.metrics.registry

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    kit.route("GET", "/metrics", metrics)
