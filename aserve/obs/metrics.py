"""Prometheus metrics, built at scrape time from counters aserve already keeps.

Nothing here runs on the request path: the frontends count each answered
request in their :class:`~aserve.frontends.common.RequestMetrics` (one
dict increment and one histogram observation per answered request). Everything
else is read when ``GET /metrics`` is scraped, by :class:`ServerCollector`:
per-model statistics (:class:`aserve.obs.stats.ModelStats`), the batchers'
gauges, the generation counters, the reload counters, python handlers' own
metrics (:mod:`aserve.obs.handler_metrics`, as ``aserve_handler_*``), and the GPU
gauges of :class:`NvmlSampler` (a thread that polls NVML, only where NVML is present).

Names follow the Prometheus conventions (``aserve_`` prefix, base units,
``_total`` counters); ``docs/reference/metrics.md`` maps them to Triton's ``nv_inference_*``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from aserve.obs.handler_metrics import MetricSet
from aserve.obs.stats import Histogram, ModelStats

log = logging.getLogger("aserve.metrics")

NVML_INTERVAL_S = 2.0


class NvmlSampler:
    """Polls utilisation and memory of every NVIDIA GPU from a thread.

    Started only where ``pynvml`` (the ``nvidia-ml-py`` package) imports and
    NVML initialises with at least one device; otherwise it does nothing and
    no GPU metrics are exported. The loop reads ``samples``, a tuple replaced
    whole by each poll.
    """

    def __init__(self, interval_s: float = NVML_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: tuple[tuple[str, str, float, float, float], ...] = ()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None

    def start(self) -> bool:
        """Start polling if there is NVML and a GPU; True when it runs."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no package, no driver, no GPU: no GPU metrics
            log.debug("no GPU metrics: %r", exc)
            return False
        try:
            if pynvml.nvmlDeviceGetCount() == 0:
                pynvml.nvmlShutdown()
                return False
        except Exception as exc:
            log.debug("no GPU metrics: %r", exc)
            return False
        self._nvml = pynvml
        self._sample_threadsafe()
        self._thread = threading.Thread(
            target=self._run_threadsafe, name="aserve-nvml", daemon=True
        )
        self._thread.start()
        return True

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5.0)
        self._thread = None
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def _run_threadsafe(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_threadsafe()

    def _sample_threadsafe(self) -> None:
        nvml = self._nvml
        out = []
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append((str(i), _text(uuid), util, float(mem.used), float(mem.total)))
        except Exception as exc:  # a GPU gone or a driver hiccup: keep the last sample
            log.warning("NVML sampling failed: %r", exc)
            return
        self.samples = tuple(out)  # one assignment: the loop sees old or new, never a mix


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RequestCounts(Protocol):
    """What a scrape reads of the frontends' request counters
    (:class:`aserve.frontends.common.RequestMetrics`)."""

    @property
    def counts(self) -> Mapping[tuple[str, str, str, str], int]: ...
    @property
    def durations(self) -> Mapping[tuple[str, str], Histogram]: ...
    @property
    def rejected(self) -> Mapping[str, int]: ...


class ScrapedModel(Protocol):
    """What a scrape reads of a served model (a :class:`aserve.loop.runtimes.base.Runtime`)."""

    name: str
    version: str
    stats: ModelStats
    handler_metrics: MetricSet | None  # a handler's own metrics, None for other engines

    def statistics(self) -> dict[str, Any]: ...


class ServerCollector(Collector):
    """Builds aserve's metric families when scraped (on the loop), from what it is
    handed: the request counters, the served models (the routing table, iterated
    anew at each scrape), the reload counters by result and the NVML sampler."""

    def __init__(
        self,
        requests: RequestCounts,
        models: Iterable[ScrapedModel],
        reload_counts: Mapping[str, int],
        nvml: NvmlSampler,
    ) -> None:
        self._requests = requests
        self._models = models
        self._reload_counts = reload_counts
        self._nvml = nvml

    def collect(self) -> Iterator[Metric]:
        requests = self._requests
        mv = ["model", "version"]

        total = CounterMetricFamily(
            "aserve_requests",
            "Inference requests answered, by protocol and status (ok, or the error code).",
            labels=[*mv, "protocol", "status"],
        )
        for key, n in sorted(requests.counts.items()):
            total.add_metric(list(key), n)
        yield total

        duration = HistogramMetricFamily(
            "aserve_request_duration_seconds",
            "End-to-end time of successful requests, from arrival to answer.",
            labels=mv,
        )
        for key, hist in sorted(requests.durations.items()):
            duration.add_metric(list(key), hist.cumulative(), hist.sum)
        yield duration

        queue_h = _histogram(
            "aserve_queue_duration_seconds",
            "Time a request waited in its model's queue before its batch (or first step) started.",
        )
        compute_h = _histogram(
            "aserve_compute_duration_seconds",
            "Time of one batch execution (decoders: one engine step), input to output.",
        )
        batch_h = _histogram(
            "aserve_batch_size", "Items per batch execution (decoders: sequences per engine step)."
        )
        ttft_h = _histogram(
            "aserve_time_to_first_token_seconds",
            "Decoder models: time from arrival to the first generated token.",
        )
        itl_h = _histogram(
            "aserve_inter_token_latency_seconds",
            "Decoder models: time between two tokens of a sequence.",
        )
        queued = GaugeMetricFamily(
            "aserve_queue_requests", "Requests waiting in the model's queue.", labels=mv
        )
        running = GaugeMetricFamily(
            "aserve_running_batches",
            "Batches (decoders: engine steps) running in the model's executor threads.",
            labels=mv,
        )
        margin = GaugeMetricFamily(
            "aserve_admission_margin_ratio",
            "How much longer than its measured latencies admission control assumes a "
            "request takes: 1 unless admitted requests have been missing their deadlines.",
            labels=mv,
        )
        executions = CounterMetricFamily(
            "aserve_batch_executions", "Batch executions (decoders: engine steps).", labels=mv
        )
        inferences = CounterMetricFamily(
            "aserve_inferences", "Items inferred (a batch of n counts n).", labels=mv
        )
        rejected = CounterMetricFamily(
            "aserve_rejected_requests",
            'Requests refused at admission, by reason; a server-wide limit counts under model="".',
            labels=[*mv, "reason"],
        )
        timed_out = CounterMetricFamily(
            "aserve_timed_out_requests",
            "Requests whose deadline passed while queued or running.",
            labels=mv,
        )
        cancelled = CounterMetricFamily(
            "aserve_cancelled_requests",
            "Requests whose client went away while queued or running.",
            labels=mv,
        )
        generated = CounterMetricFamily(
            "aserve_generation_tokens", "Decoder models: tokens generated.", labels=mv
        )
        prompt = CounterMetricFamily(
            "aserve_prompt_tokens", "Decoder models: prompt tokens of finished requests.", labels=mv
        )
        cached = CounterMetricFamily(
            "aserve_cached_prompt_tokens",
            "Decoder models: prompt tokens of finished requests reused from the prefix cache.",
            labels=mv,
        )
        hits = CounterMetricFamily(
            "aserve_prefix_cache_hits",
            "Decoder models: finished requests whose prompt began with a prefix-cache hit.",
            labels=mv,
        )
        seqs = GaugeMetricFamily(
            "aserve_running_sequences", "Decoder models: sequences in the running batch.", labels=mv
        )
        kv = GaugeMetricFamily(
            "aserve_kv_cache_usage_ratio",
            "Decoder models: KV-cache slots in use, 0 to 1.",
            labels=mv,
        )
        active = GaugeMetricFamily(
            "aserve_active_sequences",
            "Sequence-batched models: sequences started and not yet ended or freed as idle.",
            labels=mv,
        )

        for reason, n in sorted(requests.rejected.items()):
            rejected.add_metric(["", "", reason], n)
        for rt in sorted(self._models, key=lambda rt: (rt.name, int(rt.version))):
            labels = [rt.name, rt.version]
            st = rt.stats
            doc = rt.statistics()
            queue_h.add_metric(labels, st.queue_seconds.cumulative(), st.queue_seconds.sum)
            compute_h.add_metric(labels, st.compute_seconds.cumulative(), st.compute_seconds.sum)
            batch_h.add_metric(labels, st.batch_size.cumulative(), st.batch_size.sum)
            queued.add_metric(labels, doc["pending_request_count"])
            running.add_metric(labels, doc["running_batch_count"])
            if "admission_margin" in doc:
                margin.add_metric(labels, doc["admission_margin"])
            executions.add_metric(labels, st.execution_count)
            inferences.add_metric(labels, st.inference_count)
            for reason, n in sorted(st.rejected.items()):
                rejected.add_metric([*labels, reason], n)
            timed_out.add_metric(labels, st.timed_out)
            cancelled.add_metric(labels, st.cancelled)
            if "sequences_active" in doc:
                active.add_metric(labels, doc["sequences_active"])
            gen = doc.get("generation")
            if gen is not None:
                for hist, name in ((ttft_h, "first_token_seconds"), (itl_h, "inter_token_seconds")):
                    h = getattr(st, name)
                    hist.add_metric(labels, h.cumulative(), h.sum)
                generated.add_metric(labels, gen["generated_tokens"])
                prompt.add_metric(labels, gen["prompt_tokens"])
                cached.add_metric(labels, gen["cached_prompt_tokens"])
                hits.add_metric(labels, gen["prefix_cache_hits"])
                seqs.add_metric(labels, gen["running_sequence_count"])
                kv.add_metric(labels, gen["kv_slots_in_use"] / max(1, gen["max_num_seqs"]))
        yield from (
            queue_h,
            compute_h,
            batch_h,
            queued,
            running,
            margin,
            executions,
            inferences,
            rejected,
            timed_out,
            cancelled,
            ttft_h,
            itl_h,
            generated,
            prompt,
            cached,
            hits,
            seqs,
            kv,
            active,
        )

        yield from handler_families(self._models)

        reloads = CounterMetricFamily(
            "aserve_config_reloads",
            "Config reloads, by result (ok, rejected, unchanged).",
            labels=["result"],
        )
        for result, n in sorted(self._reload_counts.items()):
            reloads.add_metric([result], n)
        yield reloads

        samples = self._nvml.samples
        if samples:
            gpu = ["gpu", "gpu_uuid"]
            util = GaugeMetricFamily(
                "aserve_gpu_utilization_ratio",
                "GPU utilisation over the last NVML sample period, 0 to 1.",
                labels=gpu,
            )
            used = GaugeMetricFamily(
                "aserve_gpu_memory_used_bytes", "GPU memory in use.", labels=gpu
            )
            size = GaugeMetricFamily(
                "aserve_gpu_memory_total_bytes", "GPU memory in all.", labels=gpu
            )
            for index, uuid, u, m_used, m_total in samples:
                util.add_metric([index, uuid], u)
                used.add_metric([index, uuid], m_used)
                size.add_metric([index, uuid], m_total)
            yield from (util, used, size)


_conflicts_logged: set[tuple[str, str]] = set()


def handler_families(runtimes: Iterable[ScrapedModel]) -> list[Metric]:
    """Handlers' custom metrics (``context.metrics``), one family per name across models.

    Two models may declare the same name; when their kinds, labels or buckets
    differ, the first model's (by name) is exported and the other's is left
    out, logged once.
    """
    families: dict[str, tuple[tuple[Any, ...], Metric]] = {}
    for rt in sorted(runtimes, key=lambda rt: (rt.name, int(rt.version))):
        metric_set = rt.handler_metrics
        if metric_set is None:
            continue
        for doc in metric_set.snapshot():
            name, kind, labels = doc["name"], doc["kind"], ["model", "version", *doc["labels"]]
            signature = (kind, labels, doc["buckets"])
            entry = families.get(name)
            if entry is None:
                cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}.get(
                    kind, HistogramMetricFamily
                )
                entry = families[name] = (signature, cls(name, doc["help"], labels=labels))
            elif entry[0] != signature:
                if (name, rt.label) not in _conflicts_logged:
                    _conflicts_logged.add((name, rt.label))
                    log.warning("model %s declares metric '%s' unlike another model does; "
                                "its series are not exported", rt.label, name)  # fmt: skip
                continue
            family = entry[1]
            for values, v in doc["series"]:
                key = [rt.name, rt.version, *values]
                if kind == "histogram":
                    family.add_metric(key, _cumulative(doc["buckets"], v[0]), v[1])
                else:
                    family.add_metric(key, v)
    return [family for _, family in families.values()]


def _cumulative(bounds: list[float], counts: list[int]) -> list[tuple[str, int]]:
    out, total = [], 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


def _histogram(name: str, doc: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=["model", "version"])


class Metrics:
    """The server's metrics: request counters, the NVML sampler, the registry /metrics shows.

    ``models`` is the routing table (iterated at each scrape), ``reload_counts``
    the reloader's counters by result (a dict it updates in place).
    """

    def __init__(
        self, requests: Any, models: Iterable[ScrapedModel], reload_counts: Mapping[str, int]
    ) -> None:
        self.requests = requests  # the frontends' RequestMetrics (frontends.common)
        self.nvml = NvmlSampler()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(requests, models, reload_counts, self.nvml))
        from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, fds
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def start(self) -> None:
        if self.nvml.start():
            log.info("GPU metrics: sampling NVML every %.0fs", self.nvml.interval_s)

    async def stop(self) -> None:
        await self.nvml.stop()
