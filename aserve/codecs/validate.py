"""Checks shared by the V2 codecs (HTTP JSON/binary and gRPC protobuf).

Both wire formats describe the same things (tensors with a name, datatype and
shape; requested outputs; request parameters), so the rules and the messages
that name what was wrong live here once. Every failure raises an
:class:`aserve.errors.AserveError` subclass.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import numpy as np

from aserve.codecs.binary import bytes_elements
from aserve.codecs.datatypes import numpy_dtype
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument, TooLarge, Unimplemented
from aserve.loop.deadline import parameter_timeout_s


def check_input(
    name: Any,
    datatype: Any,
    shape: Any,
    params: Mapping[str, Any] | None,
    specs: Mapping[str, TensorSpec],
    model: str,
) -> tuple[TensorSpec, int]:
    """Validate one input's header against the model; returns its spec and element count.

    ``shape`` includes the batch dimension.
    """
    spec = specs.get(name)
    if spec is None:
        raise InvalidArgument(
            f"unknown input '{name}' for model '{model}' (inputs: {', '.join(specs)})"
        )
    if datatype != spec.datatype:
        raise InvalidArgument(
            f"input '{name}': datatype {datatype!r} does not match the model's {spec.datatype}"
        )
    if not _shape_fits(shape, spec.shape):
        raise InvalidArgument(
            f"input '{name}': shape {shape!r} does not match the model's "
            f"[batch, {', '.join(map(str, spec.shape))}]"
            + (" (-1: any size)" if -1 in spec.shape else "")
        )
    if params is not None and "shared_memory_region" in params:
        raise Unimplemented(f"input '{name}': shared memory is not supported")
    return spec, prod(shape)


def _shape_fits(shape: Any, want: list[int]) -> bool:
    """``shape`` is [batch, *want] of non-negative ints (-1 in ``want``: any size).

    Plain loops, not all()/any() over generators: this runs for every input
    of every request, and the generators cost more than the checks.
    """
    if type(shape) is not list or len(shape) != len(want) + 1:
        return False
    for d in shape:
        if type(d) is not int or d < 0:  # not bool, not float: exactly int
            return False
    i = 1
    for w in want:
        if w != -1 and w != shape[i]:
            return False
        i += 1
    return True


def tensor_from_bytes(
    name: str, datatype: str, shape: list[int], count: int, chunk: bytes | memoryview, source: str
) -> np.ndarray:
    """Decode raw little-endian tensor bytes (BYTES: length-prefixed elements).

    ``source`` names where the bytes came from, for messages
    (``binary_data_size``, ``raw_input_contents[1]``). Numeric tensors are
    zero-copy, read-only views of ``chunk``.
    """
    if datatype == "BYTES":
        try:
            return bytes_elements(memoryview(chunk), count).reshape(shape)
        except ValueError as exc:
            raise InvalidArgument(f"input '{name}': BYTES {source} {exc}") from None
    dtype = numpy_dtype(datatype)
    want = count * dtype.itemsize
    if len(chunk) != want:
        raise InvalidArgument(
            f"input '{name}': {source} is {len(chunk)} bytes, but shape {shape} of "
            f"{datatype} needs {want}"
        )
    return np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).reshape(shape)


def add_input(inputs: dict[str, np.ndarray], name: str, arr: np.ndarray) -> None:
    if name in inputs:
        raise InvalidArgument(f"input '{name}' is given more than once")
    if arr.ndim == 0:
        raise InvalidArgument(f"input '{name}': a tensor needs a batch dimension")
    inputs[name] = arr


def check_batch(
    inputs: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    variable_shapes: bool,
) -> tuple[int, tuple[Any, ...]]:
    """Every input given, one batch size within the model's limit.

    Returns the batch size and the shape key that groups requests which can
    share a batch (only models with variable dimensions need one).
    """
    if len(inputs) != len(specs):
        missing = [n for n in specs if n not in inputs]
        raise InvalidArgument(f"missing input(s) {', '.join(missing)} for model '{model}'")
    batch_size = -1
    for name, arr in inputs.items():
        if batch_size == -1:
            batch_size = arr.shape[0]
        elif arr.shape[0] != batch_size:
            raise InvalidArgument(
                f"input '{name}' has batch size {arr.shape[0]}, other inputs have {batch_size}"
            )
    if batch_size < 1:
        raise InvalidArgument("the batch dimension (first of 'shape') must be at least 1")
    if batch_size > max_batch_size:
        raise InvalidArgument(
            f"batch size {batch_size} exceeds max_batch_size {max_batch_size} of model '{model}'"
        )
    shape_key = tuple(a.shape[1:] for a in inputs.values()) if variable_shapes else ()
    return batch_size, shape_key


def check_elements(inputs: Mapping[str, np.ndarray], limit: int | None) -> None:
    """Every input within ``limits.max_tensor_elements`` (None: no limit)."""
    if limit is None:
        return
    for name, arr in inputs.items():
        if arr.size > limit:
            raise TooLarge(
                f"input '{name}' has {arr.size} elements (shape {list(arr.shape)}), over the "
                f"limit limits.max_tensor_elements {limit}"
            )


def check_output(
    name: Any, params: Mapping[str, Any] | None, specs: Mapping[str, TensorSpec], model: str
) -> None:
    """One requested output: a known name, no feature aserve does not offer."""
    if name not in specs:
        raise InvalidArgument(
            f"unknown output '{name}' for model '{model}' (outputs: {', '.join(specs)})"
        )
    if params:
        if params.get("classification"):
            raise Unimplemented(f"output '{name}': classification is not supported")
        if "shared_memory_region" in params:
            raise Unimplemented(f"output '{name}': shared memory is not supported")


def request_timeout(params: Mapping[str, Any]) -> float | None:
    """The timeout in seconds that request parameters ask for, if any.

    ``timeout_ms`` is aserve's spelling, ``timeout`` (microseconds) Triton's.
    Sequence batching is refused here: both frontends see it the same way.
    The timeout's rule is :mod:`aserve.loop.deadline`'s.
    """
    timeout_s = parameter_timeout_s(params)
    seq = params.get("sequence_id")
    if seq not in (None, 0, ""):
        raise Unimplemented("sequence batching (parameter 'sequence_id') is not supported")
    return timeout_s
