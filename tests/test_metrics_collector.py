"""The Prometheus collector reads only what it is handed, at each scrape.

:class:`aserve.obs.metrics.ServerCollector` is given the request counters,
the served models, the reload counters and the NVML sampler, not the server:
these tests build it from plain objects and check that a scrape sees their
values as they are when it runs (the routing table and the counters change
after the collector is built).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from aserve.obs.metrics import NvmlSampler, ServerCollector
from aserve.obs.stats import LATENCY_BUCKETS_S, Histogram, ModelStats


class Counters:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str, str], int] = {}
        self.durations: dict[tuple[str, str], Histogram] = {}
        self.rejected: dict[str, int] = {}


class Model:
    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self.label = f"{name}/{version}"
        self.stats = ModelStats(name, version)
        self.handler_metrics = None  # not a handler: no metrics of its own

    def statistics(self) -> dict[str, Any]:
        return {"pending_request_count": 3, "running_batch_count": 1}


def scrape(collector: ServerCollector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_a_scrape_reads_the_counters_and_models_it_was_handed_as_they_are_now() -> None:
    requests, models, reloads = Counters(), [Model("a", "1")], {"ok": 0, "rejected": 0}
    nvml = NvmlSampler()
    collector = ServerCollector(requests, models, reloads, nvml)
    assert 'aserve_config_reloads_total{result="ok"} 0.0' in scrape(collector)

    requests.counts[("a", "1", "http", "ok")] = 2
    hist = requests.durations[("a", "1")] = Histogram(LATENCY_BUCKETS_S)
    hist.observe(0.01)
    requests.rejected["max_concurrency"] = 4
    models.append(Model("b", "2"))  # a reload added it to the routing table
    models[0].stats.execution_count = 5
    reloads["ok"] += 1
    reloads["rejected"] += 2
    nvml.samples = (("0", "GPU-x", 0.5, 1.0, 2.0),)

    text = scrape(collector)
    expected = [
        'aserve_requests_total{model="a",protocol="http",status="ok",version="1"} 2.0',
        'aserve_request_duration_seconds_count{model="a",version="1"} 1.0',
        'aserve_rejected_requests_total{model="",reason="max_concurrency",version=""} 4.0',
        'aserve_batch_executions_total{model="a",version="1"} 5.0',
        'aserve_queue_requests{model="b",version="2"} 3.0',
        'aserve_config_reloads_total{result="ok"} 1.0',
        'aserve_config_reloads_total{result="rejected"} 2.0',
        'aserve_gpu_utilization_ratio{gpu="0",gpu_uuid="GPU-x"} 0.5',
    ]
    for line in expected:
        assert line in text, line


def test_no_gpu_families_without_nvml_samples() -> None:
    collector = ServerCollector(Counters(), [], {"ok": 0}, NvmlSampler())
    assert "aserve_gpu_" not in scrape(collector)
