"""Engines run a model on a device; executors are the threads that call them.

Everything in this package except ``create_engine`` runs on executor threads
(or, for ``load``/``unload``, in a worker thread during startup/shutdown) and
never touches asyncio objects: results go back through ``aserve.workers.handoff``.
"""

from __future__ import annotations

from pathlib import Path

from aserve.config import ModelConfig
from aserve.engines.base import Engine


def create_engine(config: ModelConfig, model_path: Path) -> Engine:
    """The engine named by ``config.engine``; cheap, loads nothing yet."""
    if config.engine == "torch":
        from aserve.engines.torch_engine import TorchEngine

        return TorchEngine(config, model_path)
    if config.engine == "onnx":
        from aserve.engines.onnx_engine import OnnxEngine

        return OnnxEngine(config, model_path)
    if config.engine == "tensorrt":
        from aserve.engines.tensorrt_engine import TensorRTEngine

        return TensorRTEngine(config, model_path)
    raise ValueError(f"unknown engine '{config.engine}'")  # config validation prevents this
