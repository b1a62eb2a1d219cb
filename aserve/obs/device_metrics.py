"""The shared devices on ``/metrics``: slots, busy slots, waiting models, batches run.

A collector of its own, registered by the server beside
:class:`aserve.obs.metrics.ServerCollector`; it reads the devices' snapshots
(:meth:`aserve.loop.device_scheduler.Devices.snapshot`) through a callable,
so this layer imports nothing of the loop's. Layer: ``obs``; collected on the
loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class DeviceCollector(Collector):
    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        devices = self._snapshot()
        slots = GaugeMetricFamily(
            "aserve_device_slots",
            "Batches a shared device runs at once (its slots).",
            labels=["device"],
        )
        busy = GaugeMetricFamily(
            "aserve_device_slots_busy", "Slots of a shared device running a batch now.",
            labels=["device"],
        )  # fmt: skip
        waiting = GaugeMetricFamily(
            "aserve_device_waiting_models",
            "Models of a shared device with a batch to run, waiting for a slot.",
            labels=["device"],
        )
        batches = CounterMetricFamily(
            "aserve_device_batches",
            "Batches a shared device's slots ran, by the model that ran them.",
            labels=["device", "model"],
        )
        for d in devices:
            name = str(d["name"])
            slots.add_metric([name], float(d["slots"]))
            busy.add_metric([name], float(d["busy"]))
            waiting.add_metric([name], float(d["waiting"]))
            for model, n in sorted(d["batches"].items()):
                batches.add_metric([name, model], float(n))
        yield from (slots, busy, waiting, batches)
