"""Triton's generate extension for a model of tensors (a decoupled model): the
request's JSON keys as input tensors, a response's tensors as JSON keys.

As Triton maps them: a top-level key that names one of the model's inputs is
that input, its value a JSON number, bool or string (one element) or a list,
nested as the input's shape; ``parameters`` and the keys that name no input
are the request's parameters, ``id`` its id. One request is one item: the
batch dimension is added here (``[4, 2]`` for an input of shape ``[-1]`` is
the tensor ``[[4, 2]]``), and a single value fills an input of shape ``[1]``
or ``[-1]`` as a list of one. Answers go the other way: each output of the
one item, a single element as a value, anything else as lists nested as its
shape, BYTES as UTF-8 text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from aserve.codecs.v2 import from_json
from aserve.codecs.validate import check_input
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument

OWN_KEYS = ("id", "parameters")


def generate_inputs(
    doc: Mapping[str, Any],
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    max_elements: int | None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The inputs (batch dimension first, one item) and the parameters of a
    generate request's JSON object; InvalidArgument (or TooLarge) names what is wrong."""
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgument("field 'parameters' must be an object")
    inputs: dict[str, np.ndarray] = {}
    extra: dict[str, Any] = {}
    for key, value in doc.items():
        if key in OWN_KEYS:
            continue
        spec = specs.get(key)
        if spec is None:
            extra[key] = value
            continue
        inputs[key] = _tensor(key, value, spec, specs, model, max_batch_size, max_elements)
    missing = [name for name in specs if name not in inputs]
    if missing:
        raise InvalidArgument(
            f"missing input(s) {', '.join(missing)} for model '{model}': a generate request "
            f"gives each input as a top-level key (inputs: {', '.join(specs)})"
        )
    return inputs, {**extra, **params}


def _tensor(
    name: str,
    value: Any,
    spec: TensorSpec,
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    max_elements: int | None,
) -> np.ndarray:
    shape = _nested_shape(value)
    if not shape and len(spec.shape) == 1 and spec.shape[0] in (1, -1):
        shape, value = [1], [value]  # a single value for a one-dimensional input
    if len(shape) != len(spec.shape):
        raise InvalidArgument(
            f"input '{name}' of model '{model}': a value of shape {shape} does not fit the "
            f"input's shape {spec.shape} (give a list nested as the shape)"
        )
    full = [1, *shape]
    _, count = check_input(name, spec.datatype, full, None, specs, model, max_batch_size,
                           max_elements)  # fmt: skip
    return from_json(name, spec.datatype, full, count, [value])


def _nested_shape(value: Any) -> list[int]:
    """The shape of nested lists, by their first elements (a ragged list is
    refused later, by its element count)."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def generate_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """One item's outputs (their batch dimension of 1 dropped) as JSON values."""
    doc: dict[str, Any] = {}
    for name, arr in outputs.items():
        item = arr[0] if arr.ndim and arr.shape[0] == 1 else arr
        if item.dtype.kind == "O":  # BYTES
            texts = np.empty(item.size, dtype=object)
            texts[:] = [_text(x) for x in item.reshape(-1)]
            item = texts.reshape(item.shape)
        doc[name] = item.reshape(-1)[0] if item.size == 1 else item.tolist()
        if isinstance(doc[name], np.generic):
            doc[name] = doc[name].item()
    return doc


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
