"""Models' memory and loads on ``/metrics``: state, loads, evictions, load time, footprint,
and each device's memory against its budget.

A collector of its own, registered by the server beside
:class:`aserve.obs.metrics.ServerCollector`; it reads
:meth:`aserve.loop.memory_budget.MemoryBudget.snapshot` through a callable,
so this layer imports nothing of the loop's. Layer: ``obs``; collected on the
loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

MIB = 1024 * 1024
STATES = ("LOADING", "READY", "UNLOADING", "UNAVAILABLE")


class MemoryCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        mv = ["model", "version"]
        state = GaugeMetricFamily(
            "aserve_model_state",
            "1 for the state the model version is in now, 0 for the others.",
            labels=[*mv, "state"],
        )
        loads = CounterMetricFamily(
            "aserve_model_loads", "Loads of the model, by result (ok, failed).",
            labels=[*mv, "result"],
        )  # fmt: skip
        evictions = CounterMetricFamily(
            "aserve_model_evictions",
            "Times the model was unloaded to make room under its device's memory budget.",
            labels=mv,
        )
        restores = CounterMetricFamily(
            "aserve_model_restores",
            "Loads of the model that read its weights back into the module its eviction "
            "kept (counted among the ok loads too).",
            labels=mv,
        )
        load_time = HistogramMetricFamily(
            "aserve_model_load_duration_seconds",
            "Time of each successful load and warm-up of the model.",
            labels=mv,
        )
        footprint = GaugeMetricFamily(
            "aserve_model_memory_footprint_bytes",
            "The model's memory as measured at its last load (method: cuda_allocator, rss, "
            "children_rss, file_size).",
            labels=[*mv, "device", "method"],
        )
        for m in snap["models"]:
            labels = [m["name"], m["version"]]
            for s in STATES:
                state.add_metric([*labels, s], 1.0 if m["state"] == s else 0.0)
            for result, n in sorted(m["loads"].items()):
                loads.add_metric([*labels, result], float(n))
            evictions.add_metric(labels, float(m["evictions"]))
            restores.add_metric(labels, float(m["restores"]))
            hist = m["load_seconds"]
            load_time.add_metric(labels, hist.cumulative(), hist.sum)
            if m["footprint_mib"] is not None:
                footprint.add_metric([*labels, m["device"], m["method"]], m["footprint_mib"] * MIB)
        budget = GaugeMetricFamily(
            "aserve_device_memory_budget_bytes",
            "A device's memory_budget_mib, in bytes (devices with a budget only).",
            labels=["device"],
        )
        used = GaugeMetricFamily(
            "aserve_device_memory_used_bytes",
            "What the models loaded on a device hold, as measured at their loads.",
            labels=["device"],
        )
        for d in snap["devices"]:
            if d["budget_mib"] is not None:
                budget.add_metric([d["name"]], float(d["budget_mib"]) * MIB)
            used.add_metric([d["name"]], d["used_mib"] * MIB)
        yield from (state, loads, evictions, restores, load_time, footprint, budget, used)
