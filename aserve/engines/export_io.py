"""The tensors a ``torch.export`` program (``.pt2``) declares.

Layer: ``engines`` (no asyncio); runs where the program is loaded: the torch
engine's load, when a config lists no tensors for its ``.pt2``, and ``aserve
serve`` (:mod:`aserve.commands.model_io`), which builds a config from the file.

Inputs are the program's user inputs: names, dtypes and shapes of the example
it was exported with, symbolic dimensions variable. Outputs are named by the
returned dict's keys, else ``OUTPUT0``.... The caller passes them through
:func:`aserve.engines.io_specs.reconcile`, whose rules and messages are the
engines' own.
"""

from __future__ import annotations

from typing import Any

import torch

from aserve.engines.io_specs import ModelTensor

# torch dtype names -> V2 datatypes (the unsigned wide ones exist from torch 2.3).
_TORCH_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}  # fmt: skip


def export_tensors(
    program: Any, max_batch_size: int
) -> tuple[list[ModelTensor], list[ModelTensor]]:
    """``(inputs, outputs)`` of a loaded ``ExportedProgram``; ``ValueError`` saying
    why they cannot be served (not tensors, a batch range below ``max_batch_size``)."""
    by_torch = {getattr(torch, t): v2 for t, v2 in _TORCH_DATATYPES.items() if hasattr(torch, t)}
    nodes = {n.name: n for n in program.graph.nodes}
    sig = program.graph_signature
    ins = [_tensor(name, nodes[name].meta.get("val"), by_torch) for name in sig.user_inputs]
    out_vals = [nodes[name].meta.get("val") if name in nodes else None for name in sig.user_outputs]
    spec = program.call_spec.out_spec
    keys: list[Any] = list(spec.context) if spec is not None and spec.type is dict else []
    names = [str(k) for k in keys] if len(keys) == len(out_vals) else []
    names = names or [f"OUTPUT{i}" for i in range(len(out_vals))]
    outs = [_tensor(n, v, by_torch) for n, v in zip(names, out_vals, strict=True)]
    batch_max = _batch_upper_bound(program, ins)
    if batch_max is not None and batch_max < max_batch_size:
        raise ValueError(
            f"the program's batch dimension goes up to {batch_max}, below max_batch_size "
            f"({max_batch_size}): lower max_batch_size to {batch_max} or export with a "
            "larger max"
        )
    return ins, outs


def _tensor(name: str, val: Any, by_torch: dict[Any, str]) -> ModelTensor:
    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"'{name}' is not a tensor ({type(val).__name__}): list the model's tensors "
            "(inputs/outputs in a config, --input/--output on the command line)"
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
