"""The ONNX Runtime engine (``"engine": "onnx"``): ``.onnx`` files run by onnxruntime.

One ``InferenceSession`` serves all of a model's instances: onnxruntime's
``run`` is safe to call from several threads at once, so each executor thread
calls it for its own batch. ``cpu_threads`` sets the session's intra-op
threads (one pool, shared by the instances); with 1, each ``run`` computes on
its calling thread. Intra-op threads do not spin while idle, so a waiting
pool does not take CPU from the event loop.

The model's inputs and outputs, with their element types and shapes, come
from the file: a config may leave ``inputs``/``outputs`` out and have them
filled in, or list them and have them checked (see :mod:`io_specs`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.engines.io_specs import ModelTensor, reconcile

log = logging.getLogger("aserve.engines.onnx")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# onnxruntime's type strings -> V2 datatypes. Strings (BYTES) are left out:
# onnxruntime wants str objects, the codecs produce bytes.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}


def choose_providers(device: str, available: list[str]) -> tuple[list[Any], str | None]:
    """The providers for ``device`` given onnxruntime's available ones.

    Returns ``(providers, warning)``; the warning says why a CUDA device runs
    on the CPU instead (this onnxruntime has no CUDA provider).
    """
    if device == "cpu":
        return [CPU], None
    index = int(device.partition(":")[2] or 0)
    if CUDA not in available:
        return [CPU], (
            f"device '{device}' requested, but this onnxruntime has no {CUDA} "
            f"(available: {', '.join(available)}); install onnxruntime-gpu. "
            "Running on the CPU."
        )
    return [(CUDA, {"device_id": index}), CPU], None


def describe(args: Any) -> list[ModelTensor]:
    """onnxruntime's ``NodeArg`` list as :class:`ModelTensor` (symbolic dims are dynamic)."""
    return [
        ModelTensor(
            name=a.name,
            datatype=ORT_DATATYPES.get(a.type),
            dims=tuple(d if isinstance(d, int) and d >= 0 else None for d in a.shape),
            type_name=a.type,
        )
        for a in args
    ]


class OnnxEngine(Engine):
    def __init__(self, config: ModelConfig, model_path: Path) -> None:
        super().__init__(config, model_path)
        self._session: Any = None
        self._out_names: list[str] = []

    def load(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise RuntimeError(
                "the onnx engine needs onnxruntime: pip install 'aserve[onnx]' "
                "(or onnxruntime-gpu for CUDA devices)"
            ) from None
        cfg, path = self.config, self.model_path
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        providers, warning = choose_providers(cfg.device, ort.get_available_providers())
        if warning:
            log.warning("model %s: %s", cfg.name, warning)
        options = ort.SessionOptions()
        options.intra_op_num_threads = cfg.cpu_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only; ours say what went wrong
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime's own exception types vary by version
            raise RuntimeError(f"onnxruntime cannot load {path.name}: {exc}") from exc
        used = session.get_providers()
        if providers[0] != CPU and used[0] != CUDA:
            log.warning(
                "model %s: onnxruntime could not start %s on %s (CUDA/cuDNN libraries?); "
                "running on %s",
                cfg.name, CUDA, cfg.device, ", ".join(used),
            )  # fmt: skip
        max_batch = cfg.batching.max_batch_size
        inputs = reconcile("inputs", cfg.inputs, describe(session.get_inputs()), max_batch)
        outputs = reconcile(
            "outputs", cfg.outputs, describe(session.get_outputs()), max_batch, subset_ok=True
        )
        if not cfg.inputs or not cfg.outputs:
            log.info(
                "model %s: tensors from the model file: inputs %s, outputs %s",
                cfg.name,
                ", ".join(f"{s.name} {s.datatype} {s.shape}" for s in inputs),
                ", ".join(f"{s.name} {s.datatype} {s.shape}" for s in outputs),
            )
        # The served specs from here on (ModelRuntime and the executor read them).
        self.config = cfg.model_copy(update={"inputs": inputs, "outputs": outputs})
        self._out_names = [s.name for s in outputs]
        self._session = session
        log.info("model %s: onnxruntime %s on %s", cfg.name, ort.__version__, used[0])

    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        results = self._session.run(self._out_names, inputs)
        return dict(zip(self._out_names, results, strict=True))

    def unload(self) -> None:
        self._session = None
