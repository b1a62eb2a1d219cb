"""The frontend processes of ``http.workers`` on ``/metrics`` (obs layer; collected on the
core's loop at scrape time).

One ``/metrics`` for the whole server: the requests the frontends forward or
hand over their rings are counted once, by the core, in
``aserve_requests_total`` as any HTTP request. Beside them, what only the
frontends' side knows, summed over every frontend process since start
(restarts included): how many run, how many were started again, and how many
requests took the fast path (the rings) rather than being forwarded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class FrontendCollector(Collector):
    """``snapshot()`` gives ``running``, ``restarts`` and ``ring_requests``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield GaugeMetricFamily(
            "aserve_http_frontend_processes",
            "HTTP frontend processes running (http.workers).",
            value=s["running"],
        )
        yield CounterMetricFamily(
            "aserve_http_frontend_restarts",
            "HTTP frontend processes started again after one exited.",
            value=s["restarts"],
        )
        yield CounterMetricFamily(
            "aserve_http_frontend_ring_requests",
            "KServe V2 infer requests the HTTP frontends handed to the core over their "
            "shared-memory rings (the rest were forwarded whole).",
            value=s["ring_requests"],
        )
