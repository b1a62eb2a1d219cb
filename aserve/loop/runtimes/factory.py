"""Which runtime class serves a model, by its engine."""

from __future__ import annotations

from pathlib import Path

from aserve.config import GpuConfig, ModelConfig
from aserve.loop.registry import ModelRegistry
from aserve.loop.runtimes.batched import ModelRuntime


def create_runtime(
    config: ModelConfig, base_dir: Path, registry: ModelRegistry, gpu: GpuConfig | None = None
) -> ModelRuntime:
    """A runtime for ``config``, not loaded yet (cheap: loads nothing). ``gpu``
    is the server's "gpu" block, which worker and step processes apply themselves."""
    base_dir = config.folder(base_dir)  # an archive's model resolves in its extracted folder
    if config.engine == "python":
        from aserve.loop.runtimes.handler import HandlerRuntime

        return HandlerRuntime(config, base_dir, gpu)
    if config.engine == "pipeline":
        from aserve.loop.runtimes.pipeline import PipelineRuntime

        return PipelineRuntime(config, base_dir, registry)
    if config.engine == "decoder":
        from aserve.loop.runtimes.generation import GenerationRuntime

        return GenerationRuntime(config, base_dir, gpu)  # type: ignore[return-value]
    return ModelRuntime(config, base_dir, gpu)
