"""``aserve_loop_stall_seconds``: :class:`~aserve.obs.loop_stalls.LoopStalls` on ``/metrics``.

A collector of its own, registered by the server beside
:class:`aserve.obs.metrics.ServerCollector`, so that the loop's stall
accounting (which ``aserve.Batched`` ticks too) imports no Prometheus.
Layer: ``obs``; collected on the loop, where a scrape closes the window it
falls in.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from aserve.obs.loop_stalls import LoopStalls

NAME = "aserve_loop_stall_seconds"
HELP = (
    "How long the event loop's 20 ms timer was held past its time by work of this process: "
    "the loop thread's CPU time, and other threads' CPU time while the loop waited (the GIL). "
    "Waiting for a CPU, or a stopped process, does not count. One observation a tick or scrape."
)


class LoopStallCollector(Collector):
    def __init__(self, stalls: LoopStalls) -> None:
        self._stalls = stalls

    def collect(self) -> Iterator[Metric]:
        histogram = self._stalls.read()
        family = HistogramMetricFamily(NAME, HELP)
        family.add_metric([], histogram.cumulative(), histogram.sum)
        yield family
