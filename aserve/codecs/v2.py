"""KServe V2 inference requests and responses over HTTP: JSON plus binary tensors.

Decoding validates everything a request can get wrong (names, datatypes,
shapes, sizes, parameters) and raises :class:`aserve.errors.AserveError`
subclasses whose messages name the tensor or field, so a bad request never
reaches a queue. Encoding honours ``binary_data`` per output and the request's
``binary_data_output`` default. The JSON data of an input (``inputs[i].data``)
is converted here too (the second half of this module): only the HTTP codec
reads it.

Layer ``codecs`` (no torch, no asyncio): pure; a request is decoded on the
loop, or its heavy data on a worker thread (see :class:`DecodedRequest`).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import numpy as np
import orjson

from aserve.codecs.binary import CHUNK, tensor_to_bytes
from aserve.codecs.shm import (
    REGION,
    OutputTarget,
    Release,
    SharedMemory,
    acquire,
    check_room,
    release_all,
    write_output,
)
from aserve.codecs.validate import (
    add_shape,
    check_input,
    check_output,
    check_shapes,
    request_timeout,
    tensor_from_bytes,
)
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument
from aserve.types.tensors import numpy_dtype

_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY


# A request whose tensor data costs more than this to decode is decoded on a
# worker thread (see DecodedRequest.pending): a BYTES tensor of more elements
# than this, or a JSON body of more bytes (its data may be nested lists of any
# shape, so the JSON size bounds the work, not the declared count).
OFF_LOOP_ELEMENTS = 1 << 14
OFF_LOOP_JSON_BYTES = 256 * 1024


@dataclass(slots=True)
class DecodedRequest:
    """A validated request, whichever wire format it came in.

    ``binary_default`` is the output encoding asked for when an output does
    not say: binary tensors over HTTP, raw contents over gRPC.

    ``pending`` holds the decoding of tensor data that is too much work for
    the loop, with everything about the request already checked but the data
    itself: run :meth:`decode_pending` on a worker thread (its steps are short
    numpy calls and Python loops, so the loop's thread gets the GIL between
    them), then ``inputs`` is complete.
    """

    inputs: dict[str, np.ndarray]
    batch_size: int
    shape_key: tuple[Any, ...]
    client_id: str | None
    # Requested outputs as (name, binary or None for "use the default"); None = all.
    outputs: list[tuple[str, bool | None]] | None
    binary_default: bool
    timeout_s: float | None
    parameters: dict[str, Any] | None
    pending: list[tuple[str, Callable[[], np.ndarray]]] = field(default_factory=list)
    # Requested outputs that go into the client's shared memory, by name.
    shm_outputs: dict[str, OutputTarget] | None = None
    # The uses of shared memory regions this request holds (aserve.codecs.shm): the
    # frontend ends them with release_shared_memory() once the answer is encoded.
    shm_held: list[Release] = field(default_factory=list)

    def release_shared_memory(self) -> None:
        """End this request's uses of shared memory regions (after its answer)."""
        release_all(self.shm_held)

    def decode_pending(self) -> None:
        """Decode what ``pending`` holds into ``inputs`` (raises the data's errors)."""
        for name, decode in self.pending:
            self.inputs[name] = decode()
        self.pending = []


def json_object(raw: bytes | memoryview) -> dict[str, Any]:
    """A request body (or a binary request's JSON header) that must be one JSON object."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")
    return doc


def decode_request(
    body: bytes,
    header_length: str | None,
    model: str,
    input_specs: Mapping[str, TensorSpec],
    output_specs: Mapping[str, TensorSpec],
    max_batch_size: int,
    variable_shapes: bool,
    *,
    max_elements: int | None = None,
    defer: bool = False,
    shm: SharedMemory | None = None,
) -> DecodedRequest:
    """Parse and validate one ``/infer`` body.

    ``max_elements`` is ``limits.max_tensor_elements``. With ``defer``, data
    that is much work to decode is left in ``pending`` (see
    :class:`DecodedRequest`); without it, everything is decoded here. ``shm``:
    the registered shared memory regions (None: a tensor that names one is
    refused); the request holds the regions it uses until
    :meth:`DecodedRequest.release_shared_memory`, or until this raises.
    """
    held: list[Release] = []
    try:
        return _decode(
            body, header_length, model, input_specs, output_specs, max_batch_size,
            variable_shapes, max_elements, defer, shm, held,
        )  # fmt: skip
    except BaseException:
        release_all(held)
        raise


def _decode(
    body: bytes,
    header_length: str | None,
    model: str,
    input_specs: Mapping[str, TensorSpec],
    output_specs: Mapping[str, TensorSpec],
    max_batch_size: int,
    variable_shapes: bool,
    max_elements: int | None,
    defer: bool,
    shm: SharedMemory | None,
    held: list[Release],
) -> DecodedRequest:
    binary: memoryview | None = None
    header: bytes | memoryview = body
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidArgument(
                f"header Inference-Header-Content-Length: '{header_length}' is not an integer"
            ) from None
        if n == 0:
            raise InvalidArgument(
                "raw binary bodies (Inference-Header-Content-Length: 0) are not supported; "
                "send a JSON header before the binary data"
            )
        if n < 0 or n > len(body):
            raise InvalidArgument(
                f"header Inference-Header-Content-Length: {n} is outside the body "
                f"({len(body)} bytes)"
            )
        view = memoryview(body)
        header, binary = view[:n], view[n:]
    doc = json_object(header)
    client_id = doc.get("id")
    if client_id is not None and not isinstance(client_id, str):
        raise InvalidArgument("field 'id' must be a string")
    params = doc.get("parameters")
    binary_default, timeout_s = False, None
    if params is not None:
        binary_default, timeout_s = _request_parameters(params)

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument("field 'inputs' must be a non-empty list of tensors")
    shapes: dict[str, list[int]] = {}
    inputs: dict[str, np.ndarray] = {}
    pending: list[tuple[str, Callable[[], np.ndarray]]] = []
    heavy = defer and len(header) > OFF_LOOP_JSON_BYTES
    offset = 0
    for i, item in enumerate(raw_inputs):
        name, shape, decode, used, big = _decode_input(
            i, item, input_specs, binary, offset, model, max_batch_size, max_elements, shm, held
        )
        offset += used
        add_shape(shapes, name, shape)
        if heavy or (defer and big):
            heavy = True  # this input and the rest wait for the worker thread
            pending.append((name, decode))
        else:
            inputs[name] = decode()
    if binary is not None and offset != len(binary):
        raise InvalidArgument(
            f"binary data is {len(binary)} bytes but the inputs' binary_data_size "
            f"values add up to {offset}"
        )
    batch_size, shape_key = check_shapes(
        shapes, input_specs, model, max_batch_size, variable_shapes
    )

    outputs = shm_outputs = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        outputs, shm_outputs = _requested_outputs(
            raw_outputs, output_specs, model, batch_size, shm, held
        )
    return DecodedRequest(
        inputs, batch_size, shape_key, client_id, outputs, binary_default, timeout_s, params,
        pending, shm_outputs, held,
    )  # fmt: skip


def _request_parameters(params: Any) -> tuple[bool, float | None]:
    if not isinstance(params, dict):
        raise InvalidArgument("field 'parameters' must be an object")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidArgument("parameter 'binary_data_output' must be true or false")
    return binary_default, request_timeout(params)


def _decode_input(
    index: int,
    item: Any,
    specs: Mapping[str, TensorSpec],
    binary: memoryview | None,
    offset: int,
    model: str,
    max_batch_size: int,
    max_elements: int | None,
    shm: SharedMemory | None,
    held: list[Release],
) -> tuple[str, list[int], Callable[[], np.ndarray], int, bool]:
    """One input tensor's header, checked.

    Returns its name, its shape, the function that decodes its data, the
    binary bytes it consumed, and whether decoding it is much work.
    """
    if not isinstance(item, dict):
        raise InvalidArgument(f"inputs[{index}] must be an object")
    name = item.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(f"inputs[{index}]: field 'name' must be a string")
    params = item.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgument(f"input '{name}': field 'parameters' must be an object")
    shape = item.get("shape")
    spec, count = check_input(
        name, item.get("datatype"), shape, params, specs, model, max_batch_size, max_elements
    )
    datatype = spec.datatype
    size = params.get("binary_data_size") if params is not None else None

    if params is not None and REGION in params:
        region, _, view = acquire(shm, params, f"input '{name}'", held)
        if size is not None or "data" in item:
            raise InvalidArgument(
                f"input '{name}' names a shared memory region and also carries data; "
                "give one or the other"
            )
        big = count > OFF_LOOP_ELEMENTS and datatype in ("BYTES", "BOOL")
        # Read in place: a read-only view, so that no model writes into the client's memory.
        source = f"shared memory (region '{region}')"
        decode = partial(tensor_from_bytes, name, datatype, shape, count, view.toreadonly(), source)
        return name, shape, decode, 0, big

    if size is not None:
        if binary is None:
            raise InvalidArgument(
                f"input '{name}' has binary_data_size but the request has no "
                "Inference-Header-Content-Length header"
            )
        if type(size) is not int or size < 0:
            raise InvalidArgument(
                f"input '{name}': binary_data_size must be a non-negative integer"
            )
        if offset + size > len(binary):
            raise InvalidArgument(
                f"input '{name}': binary_data_size {size} runs past the end of the body "
                f"({len(binary) - offset} bytes left)"
            )
        chunk = binary[offset : offset + size]
        big = count > OFF_LOOP_ELEMENTS and datatype in ("BYTES", "BOOL")
        return (
            name,
            shape,
            partial(tensor_from_bytes, name, datatype, shape, count, chunk, "binary_data_size"),
            size,
            big,
        )

    data = item.get("data")
    if data is None:
        raise InvalidArgument(
            f"input '{name}' has no data: give 'data' or parameters.binary_data_size"
        )
    if not isinstance(data, list):
        raise InvalidArgument(f"input '{name}': 'data' must be a list")
    return name, shape, partial(from_json, name, datatype, shape, count, data), 0, False


def _requested_outputs(
    raw: Any,
    specs: Mapping[str, TensorSpec],
    model: str,
    batch_size: int,
    shm: SharedMemory | None,
    held: list[Release],
) -> tuple[list[tuple[str, bool | None]], dict[str, OutputTarget] | None]:
    if not isinstance(raw, list):
        raise InvalidArgument("field 'outputs' must be a list")
    out: list[tuple[str, bool | None]] = []
    targets: dict[str, OutputTarget] | None = None
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument(f"outputs[{i}] must be an object with a string 'name'")
        name = item["name"]
        binary = None
        params = item.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgument(f"output '{name}': field 'parameters' must be an object")
        check_output(name, params, specs, model)
        if params is not None:
            binary = params.get("binary_data")
            if binary is not None and not isinstance(binary, bool):
                raise InvalidArgument(
                    f"output '{name}': parameter 'binary_data' must be true or false"
                )
            if REGION in params:
                region, offset, view = acquire(shm, params, f"output '{name}'", held)
                targets = targets or {}
                target = targets[name] = OutputTarget(region, offset, view)
                spec = specs[name]
                check_room(name, spec.datatype, [batch_size, *spec.shape], target)
        out.append((name, binary))
    return out, targets


def encode_response(
    model: str,
    version: str,
    req: DecodedRequest,
    outputs: Mapping[str, np.ndarray],
    output_specs: Mapping[str, TensorSpec],
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows."""
    selection: Iterable[tuple[str, bool | None]] = (
        req.outputs if req.outputs is not None else ((n, None) for n in output_specs)
    )
    entries = []
    chunks = []
    targets = req.shm_outputs
    for name, binary in selection:
        arr = outputs[name]
        datatype = output_specs[name].datatype
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        target = targets.get(name) if targets else None
        if target is not None:  # written into the client's region; the answer says where
            entry["parameters"] = target.parameters(write_output(name, arr, target))
        elif binary if binary is not None else req.binary_default:
            raw = tensor_to_bytes(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_data(name, arr)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if req.client_id is not None:
        doc["id"] = req.client_id
    header = orjson.dumps(doc, option=_DUMPS_OPTS)
    if not chunks:
        return header, None
    return b"".join((header, *chunks)), len(header)


def _json_data(name: str, arr: np.ndarray) -> Any:
    if arr.dtype.kind == "O":
        try:
            return [x.decode() if isinstance(x, bytes) else str(x) for x in arr.ravel()]
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"output '{name}' holds bytes that are not UTF-8; request it with binary_data"
            ) from None
    # orjson writes numpy arrays natively; it needs C-contiguous memory.
    return np.ascontiguousarray(arr.reshape(-1))


# --- JSON tensor data ------------------------------------------------------------------
#
# JSON tensor data (`inputs[i].data`) to numpy, taking only what KServe V2 allows.
#
# JSON numbers for the numeric types (integers for the integer types), `true`
# and `false` for BOOL, strings for BYTES. Anything else (`null`, `"1"`,
# `true` for FP32, `1.5` for INT32, a value outside the type's range) is
# refused with the element's index (row-major, counting the leaves of nested
# lists). numpy's own conversion would take all of those (`null` as NaN,
# `"1"` as 1.0, `"false"` as True), so it is not used on the elements.
#
# The common case (a flat list of numbers) stays one C loop: :mod:`array`
# converts them (refusing null, strings and non-integers for integer types,
# and out-of-range integers, all by itself), and only elements equal to 0 or 1,
# the values a `true`/`false` would have become, are looked at again.
# Large data is converted in chunks, so that decoding it on a worker thread
# lets the loop's thread take the GIL in between.

# The array module's type code that converts each numeric datatype's JSON
# numbers; FP16 goes through doubles.
_ARRAY_CODE: Final[dict[str, str]] = {
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "d",
    "FP32": "f",
    "FP64": "d",
}
for _datatype, _code in _ARRAY_CODE.items():
    _want = 8 if _datatype == "FP16" else numpy_dtype(_datatype).itemsize
    assert array.array(_code).itemsize == _want, (_datatype, _code)


# Up to this many elements, their types are looked at one by one (see _numbers).
_SMALL = 128
# The Python types of JSON numbers a float and an integer datatype take.
_NUMBER_TYPES: Final[dict[bool, set[type]]] = {False: {int, float}, True: {int}}
_SMALL_NUMBERS: Final[dict[str, np.dtype]] = {t: numpy_dtype(t) for t in _ARRAY_CODE}


def from_json(name: str, datatype: str, shape: list[int], count: int, data: list) -> np.ndarray:
    """The tensor ``data`` holds (flat or nested lists), of ``shape`` with ``count`` elements."""
    if count <= _SMALL and len(data) == count:
        # The hot path (a few numbers, flat): their types cost less to look at
        # than numpy's calls; numpy converts what passes.
        dtype = _SMALL_NUMBERS.get(datatype)
        if dtype is not None and set(map(type, data)) <= _NUMBER_TYPES[dtype.kind in "iu"]:
            try:
                return np.array(data, dtype=dtype).reshape(shape)
            except OverflowError:
                pass  # an integer out of range: _numbers says which
    convert = _CONVERT.get(datatype, _numbers)
    if len(data) == count:
        try:
            return convert(name, datatype, data, count).reshape(shape)
        except _Nested:  # lists inside, as many as the shape's first dimensions
            pass
    return convert(name, datatype, _flatten(name, data, shape, count), count).reshape(shape)


class _Nested(Exception):
    """The elements are lists: the data is nested, flatten it first."""


def _numbers(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    if count <= _SMALL:
        if set(map(type, flat)) <= _NUMBER_TYPES[datatype[0] in "IU"]:
            try:
                return np.array(flat, dtype=numpy_dtype(datatype))
            except OverflowError:
                pass
        _refuse_number(name, datatype, flat)
        raise InvalidArgument(f"input '{name}': 'data' is not valid {datatype}")
    code = _ARRAY_CODE[datatype]
    try:
        if count <= CHUNK:
            values = array.array(code, flat)
        else:
            values = array.array(code)
            for i in range(0, count, CHUNK):
                values.extend(flat[i : i + CHUNK])
    except (TypeError, OverflowError) as exc:
        _refuse_number(name, datatype, flat)
        raise InvalidArgument(f"input '{name}': 'data' is not valid {datatype}: {exc}") from None
    arr = np.frombuffer(values, dtype=np.float64 if datatype == "FP16" else numpy_dtype(datatype))
    # array takes true/false as 1/0 (bool is an int): look at those values again.
    maybe_bool = np.flatnonzero((arr == 0) | (arr == 1))
    if maybe_bool.size:
        _refuse_bools(name, datatype, flat, maybe_bool)
    return arr.astype(np.float16) if datatype == "FP16" else arr


def _refuse_number(name: str, datatype: str, flat: list) -> None:
    """Raise for the first element of ``flat`` that is not a number of ``datatype``.

    Returns without raising when that element is a list (the data is nested).
    """
    integer = datatype[0] in "IU"
    info = np.iinfo(numpy_dtype(datatype)) if integer else None
    for i, x in enumerate(flat):
        kind = type(x)
        if kind is list:
            raise _Nested
        if kind is int and info is not None and not info.min <= x <= info.max:
            raise InvalidArgument(
                f"input '{name}': element {i} of 'data' is {x}, outside {datatype}'s range "
                f"[{info.min}, {info.max}]"
            )
        if kind is bool or not (kind is int or (kind is float and not integer)):
            raise _wrong_element(name, datatype, i, x)


def _refuse_bools(name: str, datatype: str, flat: list, candidates: np.ndarray) -> None:
    for i in candidates.tolist():
        if type(flat[i]) is bool:
            raise _wrong_element(name, datatype, i, flat[i])


def _bools(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.bool_)
    for i in range(0, count, CHUNK):
        part = flat[i : i + CHUNK]
        if set(map(type, part)) - {bool}:
            _refuse_other(name, "BOOL", part, i, bool)
        out[i : i + CHUNK] = part
    return out


def _strings(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    out = np.empty(count, dtype=object)
    for i in range(0, count, CHUNK):
        part = flat[i : i + CHUNK]
        if set(map(type, part)) - {str}:
            _refuse_other(name, "BYTES", part, i, str)
        # JSON strings are valid Unicode (orjson refuses lone surrogates), so encode cannot fail.
        out[i : i + CHUNK] = list(map(str.encode, part))
    return out


def _refuse_other(name: str, datatype: str, part: list, start: int, kind: type) -> None:
    for i, x in enumerate(part):
        if type(x) is list:
            raise _Nested
        if type(x) is not kind:
            raise _wrong_element(name, datatype, start + i, x)


_CONVERT: Final = {"BOOL": _bools, "BYTES": _strings}
_TAKES: Final[dict[str, str]] = {"BOOL": "true or false", "BYTES": "strings"}


def _wrong_element(name: str, datatype: str, index: int, value: Any) -> InvalidArgument:
    takes = _TAKES.get(datatype) or ("integers" if datatype[0] in "IU" else "numbers")
    return InvalidArgument(
        f"input '{name}': element {index} of 'data' is {_describe(value)}; "
        f"{datatype} data must be JSON {takes}"
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value[:32]!r}" + ("..." if len(value) > 32 else "")
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)[:40]


def _flatten(name: str, data: list, shape: list[int], count: int) -> list:
    """The leaves of nested lists, in order; refuses more than ``count`` of them.

    A loop, not recursion: JSON may nest lists a thousand deep (orjson's
    limit), past Python's recursion limit. It stops at ``count + 1`` leaves,
    so a short shape with long data costs what the shape declares.
    """
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if type(x) is list:
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > count:
                raise _count_mismatch(name, shape, count, f"more than {count}")
        else:
            stack.pop()
    if len(out) != count:
        raise _count_mismatch(name, shape, count, str(len(out)))
    return out


def _count_mismatch(name: str, shape: list[int], count: int, got: str) -> InvalidArgument:
    return InvalidArgument(
        f"input '{name}': 'data' has {got} elements, shape {shape} needs {count}"
    )
