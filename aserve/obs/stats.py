"""Per-model inference statistics (the KServe/Triton statistics extension).

Counters are plain ints updated on the loop only, so no locks are needed.
Durations are nanoseconds, as the statistics protocol reports them.
:class:`Histogram` keeps fixed-bucket counts (seconds) for the Prometheus
exporter (``aserve/obs/metrics.py``), which reads them only when scraped.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

# Upper bounds of the histogram buckets (Prometheus ``le``); +Inf is implied.
# From 50 us: a small model's request takes well under a millisecond end to
# end, and with one bucket below 0.5 ms its p50 and p99 would be that bucket.
LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    """Counts of observations per fixed bucket, and their sum.

    An observation is a bisect and a list increment: cheap enough for the
    places that already record statistics. ``counts[i]`` holds the values
    ``bounds[i-1] < v <= bounds[i]``; the last entry those above every bound.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` per bucket, ``+Inf`` last (Prometheus' form)."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class BatchSizeStats:
    __slots__ = ("compute_infer", "compute_input", "compute_output")

    def __init__(self) -> None:
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()


class ModelStats:
    """What one model version has done since it was loaded."""

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self.last_inference_ms = 0
        self.inference_count = 0  # items (a batch of n counts n)
        self.execution_count = 0  # batches
        self.success = Duration()  # end to end, per request
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.rejected: dict[str, int] = {"queue_full": 0, "deadline_unmeetable": 0}
        self.timed_out = 0
        self.cancelled = 0
        self.batch_sizes: dict[int, BatchSizeStats] = {}
        # For /metrics: per request queue time, per execution compute time and size;
        # per generated token time to first token and between tokens (decoders).
        self.queue_seconds = Histogram(LATENCY_BUCKETS_S)
        self.compute_seconds = Histogram(LATENCY_BUCKETS_S)
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self.first_token_seconds = Histogram(TOKEN_LATENCY_BUCKETS_S)
        self.inter_token_seconds = Histogram(TOKEN_LATENCY_BUCKETS_S)
        # Its footprint and loads (aserve.loop.device_memory.ModelMemory.doc), once loaded.
        self.memory: dict[str, Any] | None = None

    def record_batch(
        self, size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        self.execution_count += 1
        self.inference_count += size
        self.last_inference_ms = int(time.time() * 1000)
        # Triton's convention: request-level compute times count each request once.
        self.compute_input.add(input_ns, requests)
        self.compute_infer.add(infer_ns, requests)
        self.compute_output.add(output_ns, requests)
        self.compute_seconds.observe((input_ns + infer_ns + output_ns) / 1e9)
        self.batch_size.observe(size)
        per_size = self.batch_sizes.get(size)
        if per_size is None:
            per_size = self.batch_sizes[size] = BatchSizeStats()
        per_size.compute_input.add(input_ns)
        per_size.compute_infer.add(infer_ns)
        per_size.compute_output.add(output_ns)

    def as_dict(self, pending: int, running: int) -> dict[str, Any]:
        """The model's entry of ``{"model_stats": [...]}``, plus aserve's own gauges."""
        empty = {"count": 0, "ns": 0}
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": empty,
                "cache_miss": empty,
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": s.compute_input.as_dict(),
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": s.compute_output.as_dict(),
                }
                for size, s in sorted(self.batch_sizes.items())
            ],
            "memory_usage": [],
            # aserve extensions: live queue state and refusals.
            "pending_request_count": pending,
            "running_batch_count": running,
            "rejected": dict(self.rejected),
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            **({"memory": self.memory} if self.memory is not None else {}),
        }
