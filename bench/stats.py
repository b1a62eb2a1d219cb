"""What aserve did inside a measured window, from two snapshots of its statistics.

The snapshots are ``/v2/models/{name}/stats`` entries (Triton's statistics
format): per-batch-size counts and nanoseconds, request-level durations.
"""

from __future__ import annotations

from typing import Any


def window_delta(before: dict[str, Any], after: dict[str, Any], window_s: float) -> dict[str, Any]:
    """What aserve did during one point: batches by size, time in the model, queueing."""

    def sizes(entry: dict[str, Any]) -> dict[int, dict[str, int]]:
        return {
            int(b["batch_size"]): {
                "count": b["compute_infer"]["count"],
                "infer_ns": b["compute_infer"]["ns"],
                "input_ns": b["compute_input"]["ns"],
                "output_ns": b["compute_output"]["ns"],
            }
            for b in entry["batch_stats"]
        }

    b_sizes, a_sizes = sizes(before), sizes(after)
    batches = counts_delta(
        {s: v["count"] for s, v in b_sizes.items()}, {s: v["count"] for s, v in a_sizes.items()}
    )
    ns = {
        key: sum(v[key] for v in a_sizes.values()) - sum(v[key] for v in b_sizes.values())
        for key in ("infer_ns", "input_ns", "output_ns")
    }
    bi, ai = before["inference_stats"], after["inference_stats"]
    requests = ai["success"]["count"] - bi["success"]["count"]
    queue_ns = ai["queue"]["ns"] - bi["queue"]["ns"]
    items = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    batch_ms = {
        str(size): (a_sizes[size]["infer_ns"] - b_sizes.get(size, {}).get("infer_ns", 0)) / n / 1e6
        for size, n in batches.items()
    }
    return {
        "batches_by_size": {str(k): v for k, v in batches.items()},
        "model_ms_by_size": batch_ms,
        "items": items,
        "executions": executions,
        "mean_batch_size": items / executions if executions else 0.0,
        "model_s": ns["infer_ns"] / 1e9,
        "model_busy": ns["infer_ns"] / 1e9 / window_s,
        "stack_inputs_s": ns["input_ns"] / 1e9,
        "split_outputs_s": ns["output_ns"] / 1e9,
        "mean_queue_ms": queue_ns / requests / 1e6 if requests else 0.0,
        "rejected": after["rejected"],
        "timed_out": after["timed_out"] - before["timed_out"],
        "admission_margin": after.get("admission_margin"),
    }


def counts_delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    delta = {size: n - before.get(size, 0) for size, n in after.items()}
    return {size: n for size, n in sorted(delta.items()) if n > 0}
