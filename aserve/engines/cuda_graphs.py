"""CUDA graph capture for the torch engine (``"cuda_graphs": true``, CUDA devices only).

Each instance captures one graph per batch size it serves most (the
preferred batch sizes and the maximum) on its own stream, after running the
model a few times there. A captured graph owns static input and output
tensors: a batch of exactly that size is copied into the inputs, the graph
is replayed with one launch, and the outputs are copied out; other sizes run
eagerly. Graphs are never padded into: a model whose items interact across
the batch would answer differently.

A model that cannot be captured (it synchronizes with the host, changes
shapes with its input values, allocates outside the graph's pool...) is
logged once and served eagerly. Runs on the instance's executor thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from aserve.config import TensorSpec

log = logging.getLogger("aserve.engines.cuda_graphs")

WARMUP_RUNS = 3  # TorchScript's profiling executor settles after two runs

# Instances capture one at a time: a capture must not see another thread's
# allocations, and the start-up cost of serializing is small.
_capture_lock = threading.Lock()


class CapturedGraph:
    """One captured batch size: replay after copying a batch into ``inputs``."""

    __slots__ = ("graph", "inputs", "outputs", "size")

    def __init__(
        self,
        size: int,
        graph: torch.cuda.CUDAGraph,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
    ) -> None:
        self.size = size
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs

    def replay(self) -> list[torch.Tensor]:
        """Launch the graph on the current stream; returns its (reused) output tensors."""
        self.graph.replay()
        return self.outputs


def capture_sizes(preferred: Sequence[int], max_batch_size: int) -> list[int]:
    """The batch sizes to capture, largest first (smaller graphs reuse its memory pool)."""
    return sorted({*preferred, max_batch_size}, reverse=True)


def capture(
    module: Callable[..., Any],
    specs: Sequence[TensorSpec],
    sizes: Sequence[int],
    device: torch.device,
    stream: torch.cuda.Stream,
    as_list: Callable[[Any], list[torch.Tensor]],
    label: str,
) -> dict[int, CapturedGraph]:
    """Capture ``module`` for each batch size on ``stream``; ``{}`` when it cannot be."""
    from aserve.types.tensors import numpy_dtype

    if any(-1 in s.shape for s in specs):  # config validation refuses this; be safe anyway
        log.warning("model %s: cuda_graphs needs fixed input shapes; running eagerly", label)
        return {}
    dtypes = [torch.from_numpy(np.zeros(0, numpy_dtype(s.datatype))).dtype for s in specs]
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, CapturedGraph] = {}
    with _capture_lock, torch.inference_mode():
        for size in sizes:
            try:
                # Everything on the instance's stream, after what the device already queued.
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    static_in = [
                        torch.zeros((size, *s.shape), dtype=dt, device=device)
                        for s, dt in zip(specs, dtypes, strict=True)
                    ]
                    for _ in range(WARMUP_RUNS):
                        module(*static_in)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: other instance threads may keep allocating meanwhile.
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    static_out = as_list(module(*static_in))
                stream.synchronize()
            except Exception as exc:
                # A failed capture leaves nothing running; the model still runs eagerly.
                torch.cuda.synchronize(device)
                log.warning(
                    "model %s: CUDA graph capture failed at batch size %d (%s: %s); "
                    "running eagerly at every batch size",
                    label, size, type(exc).__name__, exc,
                )  # fmt: skip
                return {}
            graphs[size] = CapturedGraph(size, graph, static_in, static_out)
    log.info(
        "model %s: captured CUDA graphs for batch sizes %s",
        label, ", ".join(map(str, sorted(graphs))),
    )  # fmt: skip
    return graphs
