"""Which runtime class serves a model, by its engine (layer: loop; runs on the loop)."""

from __future__ import annotations

from pathlib import Path

from aserve.config import GpuConfig, ModelConfig
from aserve.loop.memory_budget import MemoryBudget
from aserve.loop.registry import ModelRegistry
from aserve.loop.runtimes.base import Runtime
from aserve.loop.runtimes.batched import ModelRuntime
from aserve.loop.runtimes.decoupled import DecoupledRuntime
from aserve.loop.runtimes.generation import GenerationRuntime
from aserve.loop.runtimes.handler import HandlerRuntime
from aserve.loop.runtimes.on_demand import OnDemandRuntime
from aserve.loop.runtimes.pipeline import PipelineRuntime


def create_runtime(
    config: ModelConfig,
    base_dir: Path,
    registry: ModelRegistry,
    gpu: GpuConfig | None = None,
    memory: MemoryBudget | None = None,
) -> Runtime:
    """A runtime for ``config``, not loaded yet (cheap: loads nothing). ``gpu``
    is the server's "gpu" block, which worker and step processes apply themselves.
    With ``memory`` (the server's), a model with ``"load": "on_demand"`` gets an
    :class:`OnDemandRuntime`, which makes a runtime of its engine at each load."""
    if memory is not None and config.load == "on_demand":
        return OnDemandRuntime(
            config, config.folder(base_dir), gpu,
            lambda c: create_runtime(c, base_dir, registry, gpu), memory,
        )  # fmt: skip
    base_dir = config.folder(base_dir)  # an archive's model resolves in its extracted folder
    if config.engine == "python" and config.decoupled:
        return DecoupledRuntime(config, base_dir, gpu)
    if config.engine == "python":
        return HandlerRuntime(config, base_dir, gpu)
    if config.engine == "pipeline":
        return PipelineRuntime(config, base_dir, registry, gpu)
    if config.engine == "decoder":
        return GenerationRuntime(config, base_dir, gpu)
    return ModelRuntime(config, base_dir, gpu)
