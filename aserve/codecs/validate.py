"""Checks shared by the V2 codecs (HTTP JSON/binary and gRPC protobuf).

Both wire formats describe the same things (tensors with a name, datatype and
shape; requested outputs; request parameters), so the rules and the messages
that name what was wrong live here once. Every failure raises an
:class:`aserve.errors.AserveError` subclass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aserve.codecs.binary import bytes_elements
from aserve.codecs.timeouts import parameter_timeout_s
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument, TooLarge, Unavailable, Unimplemented
from aserve.types.tensors import DATATYPES, numpy_dtype

# numpy (and every engine) counts in int64: a dimension, and the product of a
# shape's dimensions times the element size, must stay below this.
INT64_MAX = 2**63 - 1
_ITEMSIZE = {t: numpy_dtype(t).itemsize for t in DATATYPES}


def check_input(
    name: Any,
    datatype: Any,
    shape: Any,
    params: Mapping[str, Any] | None,
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    max_elements: int | None,
) -> tuple[TensorSpec, int]:
    """Validate one input's header against the model; returns its spec and element count.

    ``shape`` includes the batch dimension. Everything is checked from what the
    request declares, before any data is decoded: the cost of decoding is
    bounded here (``max_elements``: ``limits.max_tensor_elements``, None for
    no limit; the wire formats bound the rest, see :func:`tensor_from_bytes`).
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
    count = _element_count(name, shape, spec)
    if shape[0] > max_batch_size:
        raise InvalidArgument(
            f"input '{name}': batch size {shape[0]} exceeds max_batch_size {max_batch_size} "
            f"of model '{model}'"
        )
    if max_elements is not None and count > max_elements:
        raise TooLarge(
            f"input '{name}' has {count} elements (shape {shape}), over the "
            f"limit limits.max_tensor_elements {max_elements}"
        )
    # Shared memory (parameters.shared_memory_region) is the codec's: aserve.codecs.shm.
    return spec, count


def _element_count(name: str, shape: Any, spec: TensorSpec) -> int:
    """The element count of ``shape``: [batch, *spec.shape] (-1 there: any size).

    Plain loops, not all()/any() over generators: this runs for every input
    of every request, and the generators cost more than the checks.
    """
    want = spec.shape
    if type(shape) is not list or len(shape) != len(want) + 1:
        raise _shape_mismatch(name, shape, want)
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:  # not bool, not float: exactly int
            raise _shape_dimension(name, shape, want)
        count *= d
    i = 1
    for w in want:
        if w != -1 and w != shape[i]:
            raise _shape_mismatch(name, shape, want)
        i += 1
    # numpy must be able to index the shape, zero-sized or not: the product of
    # its non-zero dimensions, in bytes, within int64 (a dimension too, then).
    span = count
    if not count:
        span = 1
        for d in shape:
            span *= d or 1
    if span * _ITEMSIZE[spec.datatype] > INT64_MAX:
        raise InvalidArgument(
            f"input '{name}': shape {shape} is too large for a tensor (its dimensions "
            f"multiply past {INT64_MAX} bytes of {spec.datatype})"
        )
    return count


def _shape_dimension(name: str, shape: Any, want: list[int]) -> InvalidArgument:
    for i, d in enumerate(shape):
        if type(d) is int and d < 0:
            return InvalidArgument(
                f"input '{name}': dimension {i} of shape {shape} is {d}; dimensions must "
                "not be negative"
            )
    return _shape_mismatch(name, shape, want)


def _shape_mismatch(name: str, shape: Any, want: list[int]) -> InvalidArgument:
    return InvalidArgument(
        f"input '{name}': shape {shape!r} does not match the model's "
        f"[batch, {', '.join(map(str, want))}]" + (" (-1: any size)" if -1 in want else "")
    )


def tensor_from_bytes(
    name: str, datatype: str, shape: list[int], count: int, chunk: bytes | memoryview, source: str
) -> np.ndarray:
    """Decode raw little-endian tensor bytes (BYTES: length-prefixed elements).

    ``source`` names where the bytes came from, for messages
    (``binary_data_size``, ``raw_input_contents[1]``). Numeric tensors are
    zero-copy, read-only views of ``chunk``. The bytes bound the count: a
    number takes its width, a BYTES element at least its 4-byte length, both
    checked before anything is allocated.
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
    if datatype == "BOOL":
        bad = np.flatnonzero(np.frombuffer(chunk, np.uint8) > 1)
        if bad.size:  # numpy would take any non-zero byte as a bool it cannot print or compare
            raise InvalidArgument(
                f"input '{name}': BOOL {source} byte {bad[0]} is {chunk[bad[0]]}; "
                "BOOL bytes must be 0 or 1"
            )
    return np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).reshape(shape)


def add_shape(shapes: dict[str, list[int]], name: str, shape: list[int]) -> None:
    if name in shapes:
        raise InvalidArgument(f"input '{name}' is given more than once")
    shapes[name] = shape


def check_batch(
    inputs: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    variable_shapes: bool,
) -> tuple[int, tuple[Any, ...]]:
    """Every input given, one batch size within the model's limit (for tensors).

    Returns the batch size and the shape key that groups requests which can
    share a batch (only models with variable dimensions need one).
    """
    shapes = {name: arr.shape for name, arr in inputs.items()}
    return check_shapes(shapes, specs, model, max_batch_size, variable_shapes)


def check_shapes(
    shapes: Mapping[str, Sequence[int]],
    specs: Mapping[str, TensorSpec],
    model: str,
    max_batch_size: int,
    variable_shapes: bool,
) -> tuple[int, tuple[Any, ...]]:
    """:func:`check_batch` from the shapes alone: a request is checked before its data is decoded."""
    if len(shapes) != len(specs):
        missing = [n for n in specs if n not in shapes]
        raise InvalidArgument(f"missing input(s) {', '.join(missing)} for model '{model}'")
    batch_size = -1
    for name, shape in shapes.items():
        if not len(shape):
            raise InvalidArgument(f"input '{name}': a tensor needs a batch dimension")
        if batch_size == -1:
            batch_size = shape[0]
        elif shape[0] != batch_size:
            raise InvalidArgument(
                f"input '{name}' has batch size {shape[0]}, other inputs have {batch_size}"
            )
    if batch_size < 1:
        raise InvalidArgument("the batch dimension (first of 'shape') must be at least 1")
    if batch_size > max_batch_size:
        raise InvalidArgument(
            f"batch size {batch_size} exceeds max_batch_size {max_batch_size} of model '{model}'"
        )
    shape_key = tuple(tuple(s[1:]) for s in shapes.values()) if variable_shapes else ()
    return batch_size, shape_key


def same_io(before: Any, now: Any) -> Any:
    """The runtime ``now`` routes to, when a request decoded against ``before`` fits it.

    A request whose data was decoded off the loop looks routing up again
    (a reload may have swapped the runtime meanwhile); a runtime with other
    inputs or batching cannot take what was decoded.
    """
    if now is not before and (
        now.input_specs != before.input_specs
        or now.output_specs != before.output_specs
        or now.max_batch_size != before.max_batch_size
    ):
        raise Unavailable(
            f"model '{now.name}' was reloaded with other inputs or outputs while the "
            "request was decoded; retry"
        )
    return now


def check_output(
    name: Any, params: Mapping[str, Any] | None, specs: Mapping[str, TensorSpec], model: str
) -> None:
    """One requested output: a known name, no feature aserve does not offer (shared
    memory is the codec's: :mod:`aserve.codecs.shm`)."""
    if name not in specs:
        raise InvalidArgument(
            f"unknown output '{name}' for model '{model}' (outputs: {', '.join(specs)})"
        )
    if params:
        if params.get("classification"):
            raise Unimplemented(f"output '{name}': classification is not supported")


def request_timeout(params: Mapping[str, Any]) -> float | None:
    """The timeout in seconds that request parameters ask for, if any.

    ``timeout_ms`` is aserve's spelling, ``timeout`` (microseconds) Triton's.
    The timeout's rule is :func:`aserve.frontends.common.resolve_deadline`'s.
    (The sequence parameters are the model's to read: :mod:`aserve.codecs.sequence`.)
    """
    return parameter_timeout_s(params)
