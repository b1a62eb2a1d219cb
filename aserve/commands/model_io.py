"""The inputs and outputs a model file declares, for ``aserve serve`` (no config).

``.pt2`` (torch.export): as the torch engine reads them when a config lists
none (:mod:`aserve.engines.export_io`).
``.onnx``: onnxruntime's description of the graph, as the onnx engine reads it.
``.plan`` / ``.engine``: the TensorRT engine's I/O tensors, as the tensorrt
engine reads them. Each goes through :func:`io_specs.reconcile`, so the
rules (a leading dynamic batch dimension, servable element types) and the
messages are the engines' own.

Heavy imports (torch, onnxruntime, TensorRT) happen inside the functions.
"""

from __future__ import annotations

from pathlib import Path

from aserve.config import TensorSpec
from aserve.engines.io_specs import ModelTensor, reconcile

Specs = tuple[list[TensorSpec], list[TensorSpec]]


def read_io(path: Path, engine: str, max_batch_size: int, device: str) -> Specs:
    """``(inputs, outputs)`` of the model file; raises ``ValueError`` saying why not."""
    if engine == "onnx":
        ins, outs = _onnx_tensors(path)
        subset_ok = True
    elif engine == "tensorrt":
        ins, outs = _tensorrt_tensors(path, device)
        subset_ok = False
    else:
        ins, outs = _export_tensors(path, max_batch_size)
        subset_ok = False
    inputs = reconcile("inputs", [], ins, max_batch_size)
    outputs = reconcile("outputs", [], outs, max_batch_size, subset_ok=subset_ok)
    return inputs, outputs


def _onnx_tensors(path: Path) -> tuple[list[ModelTensor], list[ModelTensor]]:
    import onnxruntime as ort

    from aserve.engines.onnx_engine import describe

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # Only the graph's signature is wanted: skip optimizing it.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime's exception types vary by version
        raise ValueError(f"onnxruntime cannot load {path.name}: {exc}") from None
    return describe(session.get_inputs()), describe(session.get_outputs())


def _tensorrt_tensors(path: Path, device: str) -> tuple[list[ModelTensor], list[ModelTensor]]:
    from aserve.engines import cuda_rt
    from aserve.engines.tensorrt_engine import describe_engine, import_tensorrt

    trt = import_tensorrt()
    cuda_rt.set_device(int(device.partition(":")[2] or 0))
    logger = trt.Logger(trt.Logger.ERROR)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise ValueError(
            f"TensorRT {trt.__version__} cannot load {path.name}: an engine only loads in the "
            "TensorRT version and on the GPU model it was built for"
        )
    return describe_engine(trt, engine)


def _export_tensors(path: Path, max_batch_size: int) -> tuple[list[ModelTensor], list[ModelTensor]]:
    from aserve.engines.export_file import UnsafeProgram, load_exported_program
    from aserve.engines.export_io import export_tensors

    try:
        program = load_exported_program(path)
    except UnsafeProgram:
        raise
    except Exception as exc:  # a truncated or foreign file; torch raises many kinds
        raise ValueError(f"torch.export cannot load {path.name}: {exc}") from None
    return export_tensors(program, max_batch_size)
