"""Engines run a model on a device: the worker side, which never imports asyncio.

Layer: ``engines`` (above ``config``/``codecs``, below ``workers``). What is
here runs wherever an executor calls it: on an executor thread of the server
process, in a worker or step process (:mod:`aserve.workers.child`), or, for
``load``/``unload``, in a worker thread during startup and shutdown; a CPU
torch model's tiny batches may also run on the loop's thread
(:class:`aserve.workers.thread_pool.ExecutorPool`, inline). Nothing here
touches an asyncio object: executors (:mod:`aserve.workers`) take the jobs
from the loop and hand the results back (the import contract in
``pyproject.toml`` refuses an ``asyncio`` import here).
"""

from __future__ import annotations

from pathlib import Path

from aserve.config import ModelConfig
from aserve.engines.base import Engine


def create_engine(config: ModelConfig, model_path: Path) -> Engine:
    """The engine named by ``config.engine``; cheap, loads nothing yet."""
    # Imported here, by name: each engine module imports its runtime (torch,
    # onnxruntime, tensorrt), heavy and optional, that other engines never need.
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
