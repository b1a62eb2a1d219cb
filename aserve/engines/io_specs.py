"""Reconciling a model file's own inputs/outputs with the ones a config declares.

ONNX and TensorRT models carry their tensor names, element types and shapes.
An engine describes them as :class:`ModelTensor` and :func:`reconcile` either
fills in the config's specs from them (when the config lists none) or checks
the config against them, with a message that names the tensor, what the
config says and what the model says. Pure functions: no engine is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aserve.config import TensorSpec


@dataclass(frozen=True)
class ModelTensor:
    """One input or output as the model file describes it.

    ``datatype`` is the V2 name, or ``None`` for an element type aserve cannot
    carry (``type_name`` says which). ``dims`` includes the batch dimension;
    ``None`` is a dynamic dimension.
    """

    name: str
    datatype: str | None
    dims: tuple[int | None, ...]
    type_name: str = ""


class ModelMismatch(ValueError):
    """The config and the model file disagree; the message says how to fix it."""


def reconcile(
    kind: str,
    declared: Sequence[TensorSpec],
    model: Sequence[ModelTensor],
    max_batch_size: int,
    *,
    subset_ok: bool = False,
) -> list[TensorSpec]:
    """The specs to serve ``kind`` ("inputs"/"outputs") with.

    With nothing declared, every model tensor becomes a spec (dynamic
    dimensions become -1). Otherwise the declared specs are checked and
    returned as given: the same names (a subset of the model's when
    ``subset_ok``), the same datatypes, and shapes the model accepts.
    Every model tensor must have a leading batch dimension that takes
    1..``max_batch_size``.
    """
    by_name = {t.name: t for t in model}
    if not declared:
        specs = []
        for t in model:
            _check_batch_dim(kind, t, max_batch_size)
            specs.append(
                TensorSpec(
                    name=t.name,
                    datatype=_served_datatype(kind, t),  # type: ignore[arg-type]
                    shape=[-1 if d is None else d for d in t.dims[1:]],
                )
            )
        return specs

    names = [s.name for s in declared]
    unknown = [n for n in names if n not in by_name]
    missing = [t.name for t in model if t.name not in names]
    if unknown or (missing and not subset_ok):
        parts = []
        if unknown:
            parts.append(f"the model has no {kind[:-1]}(s) {', '.join(unknown)}")
        if missing and not subset_ok:
            parts.append(f"the config does not list {', '.join(missing)}")
        model_names = ", ".join(t.name for t in model)
        raise ModelMismatch(f"{kind}: {'; '.join(parts)} (the model's {kind}: {model_names})")
    for spec in declared:
        t = by_name[spec.name]
        datatype = _served_datatype(kind, t)
        if spec.datatype != datatype:
            raise ModelMismatch(
                f"{kind[:-1]} '{spec.name}': the config declares {spec.datatype}, "
                f"the model's is {datatype}"
            )
        _check_batch_dim(kind, t, max_batch_size)
        model_shape = [-1 if d is None else d for d in t.dims[1:]]
        if len(spec.shape) != len(model_shape) or any(
            m != -1 and d != m for d, m in zip(spec.shape, model_shape, strict=False)
        ):
            raise ModelMismatch(
                f"{kind[:-1]} '{spec.name}': the config declares shape {spec.shape}, "
                f"the model's is {model_shape} (batch dimension excluded; -1 is variable)"
            )
    return list(declared)


def _served_datatype(kind: str, t: ModelTensor) -> str:
    if t.datatype is None:
        raise ModelMismatch(
            f"{kind[:-1]} '{t.name}': element type {t.type_name or '?'} is not one aserve serves"
        )
    return t.datatype


def _check_batch_dim(kind: str, t: ModelTensor, max_batch_size: int) -> None:
    if not t.dims:
        raise ModelMismatch(
            f"{kind[:-1]} '{t.name}' is a scalar; every model takes a leading batch dimension"
        )
    first = t.dims[0]
    if first is not None and not (first == 1 and max_batch_size == 1):
        hint = " or set batching.max_batch_size to 1" if first == 1 else ""
        raise ModelMismatch(
            f"{kind[:-1]} '{t.name}' has a fixed batch dimension of {first}: export the model "
            f"with a dynamic batch dimension{hint}"
        )
