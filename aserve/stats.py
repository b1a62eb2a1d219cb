"""Per-model inference statistics (the KServe/Triton statistics extension).

Counters are plain ints updated on the loop only, so no locks are needed.
Durations are nanoseconds, as the statistics protocol reports them.
"""

from __future__ import annotations

import time
from typing import Any


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
        }
