"""The inputs and outputs a model file declares, for ``aserve serve`` (no config).

``.pt2`` (torch.export): the program's user inputs (names, dtypes and shapes
of the example it was exported with; symbolic dimensions are variable) and
its outputs (named by the returned dict's keys, else ``OUTPUT0``...).
``.onnx``: onnxruntime's description of the graph, as the onnx engine reads it.
``.plan`` / ``.engine``: the TensorRT engine's I/O tensors, as the tensorrt
engine reads them. Each goes through :func:`io_specs.reconcile`, so the
rules (a leading dynamic batch dimension, servable element types) and the
messages are the engines' own.

Heavy imports (torch, onnxruntime, TensorRT) happen inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aserve.config import TensorSpec
from aserve.engines.io_specs import ModelTensor, reconcile

# torch dtype names -> V2 datatypes (the unsigned wide ones exist from torch 2.3).
_TORCH_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}  # fmt: skip

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
    import torch

    from aserve.engines.export_file import UnsafeProgram, load_exported_program

    try:
        program = load_exported_program(path)
    except UnsafeProgram:
        raise
    except Exception as exc:  # a truncated or foreign file; torch raises many kinds
        raise ValueError(f"torch.export cannot load {path.name}: {exc}") from None
    by_torch = {getattr(torch, t): v2 for t, v2 in _TORCH_DATATYPES.items() if hasattr(torch, t)}
    nodes = {n.name: n for n in program.graph.nodes}
    sig = program.graph_signature
    ins = [
        _tensor(name, nodes[name].meta.get("val"), by_torch, program) for name in sig.user_inputs
    ]
    out_vals = [nodes[name].meta.get("val") if name in nodes else None for name in sig.user_outputs]
    spec = program.call_spec.out_spec
    keys: list[Any] = list(spec.context) if spec is not None and spec.type is dict else []
    names = [str(k) for k in keys] if len(keys) == len(out_vals) else []
    names = names or [f"OUTPUT{i}" for i in range(len(out_vals))]
    outs = [_tensor(n, v, by_torch, program) for n, v in zip(names, out_vals, strict=True)]
    batch_max = _batch_upper_bound(program, ins)
    if batch_max is not None and batch_max < max_batch_size:
        raise ValueError(
            f"the program's batch dimension goes up to {batch_max}, below max_batch_size "
            f"({max_batch_size}): set --max-batch-size {batch_max} or export with a larger max"
        )
    return ins, outs


def _tensor(name: str, val: Any, by_torch: dict[Any, str], program: Any) -> ModelTensor:
    import torch

    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"'{name}' is not a tensor ({type(val).__name__}): give the model's tensors with "
            "--input/--output"
        )
    dims = tuple(d if isinstance(d, int) else None for d in val.shape)
    return ModelTensor(name, by_torch.get(val.dtype), dims, str(val.dtype))


def _batch_upper_bound(program: Any, ins: list[ModelTensor]) -> int | None:
    """The largest batch the program was exported for (its first input's dim 0 range)."""
    if not ins:
        return None
    node = next(n for n in program.graph.nodes if n.name == ins[0].name)
    dim = node.meta["val"].shape[0]
    expr = getattr(getattr(dim, "node", None), "expr", None)
    bound = program.range_constraints.get(expr) if expr is not None else None
    upper = getattr(bound, "upper", None)
    try:
        return int(upper) if upper is not None else None
    except (TypeError, ValueError):  # an unbounded range (sympy oo)
        return None
