"""KServe V2 inference requests and responses over HTTP: JSON plus binary tensors.

Decoding validates everything a request can get wrong (names, datatypes,
shapes, sizes, parameters) and raises :class:`aserve.errors.AserveError`
subclasses whose messages name the tensor or field, so a bad request never
reaches a queue. Encoding honours ``binary_data`` per output and the request's
``binary_data_output`` default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from aserve.codecs.binary import tensor_to_bytes
from aserve.codecs.datatypes import numpy_dtype
from aserve.codecs.validate import (
    add_input,
    check_batch,
    check_input,
    check_output,
    request_timeout,
    tensor_from_bytes,
)
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument

_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(slots=True)
class DecodedRequest:
    """A validated request, whichever wire format it came in.

    ``binary_default`` is the output encoding asked for when an output does
    not say: binary tensors over HTTP, raw contents over gRPC.
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


def decode_request(
    body: bytes,
    header_length: str | None,
    model: str,
    input_specs: Mapping[str, TensorSpec],
    output_specs: Mapping[str, TensorSpec],
    max_batch_size: int,
    variable_shapes: bool,
) -> DecodedRequest:
    """Parse and validate one ``/infer`` body."""
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
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")

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
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(raw_inputs):
        arr, used = _decode_input(i, item, input_specs, binary, offset, model)
        offset += used
        add_input(inputs, item["name"], arr)
    if binary is not None and offset != len(binary):
        raise InvalidArgument(
            f"binary data is {len(binary)} bytes but the inputs' binary_data_size "
            f"values add up to {offset}"
        )
    batch_size, shape_key = check_batch(inputs, input_specs, model, max_batch_size, variable_shapes)

    outputs = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        outputs = _requested_outputs(raw_outputs, output_specs, model)
    return DecodedRequest(
        inputs, batch_size, shape_key, client_id, outputs, binary_default, timeout_s, params
    )


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
) -> tuple[np.ndarray, int]:
    """One input tensor; returns it and the binary bytes it consumed."""
    if not isinstance(item, dict):
        raise InvalidArgument(f"inputs[{index}] must be an object")
    name = item.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(f"inputs[{index}]: field 'name' must be a string")
    params = item.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidArgument(f"input '{name}': field 'parameters' must be an object")
    shape = item.get("shape")
    spec, count = check_input(name, item.get("datatype"), shape, params, specs, model)
    size = params.get("binary_data_size") if params is not None else None

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
        return tensor_from_bytes(name, spec.datatype, shape, count, chunk, "binary_data_size"), size

    data = item.get("data")
    if data is None:
        raise InvalidArgument(
            f"input '{name}' has no data: give 'data' or parameters.binary_data_size"
        )
    return _from_json(name, spec.datatype, shape, count, data), 0


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidArgument(f"input '{name}': 'data' must be a list")
    if datatype == "BYTES":
        flat = list(_flatten(data))
        if not all(isinstance(s, str) for s in flat):
            raise InvalidArgument(f"input '{name}': BYTES data must be JSON strings")
        arr = np.empty(len(flat), dtype=object)
        arr[:] = [s.encode() for s in flat]
    else:
        try:
            arr = np.array(data, dtype=numpy_dtype(datatype))
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidArgument(
                f"input '{name}': 'data' is not valid {datatype}: {exc}"
            ) from None
        if arr.dtype.kind == "O":
            raise InvalidArgument(f"input '{name}': 'data' is not valid {datatype}")
    if arr.size != count:
        raise InvalidArgument(
            f"input '{name}': 'data' has {arr.size} elements, shape {shape} needs {count}"
        )
    return arr.reshape(shape)


def _flatten(items: Iterable[Any]) -> Iterable[Any]:
    """The leaves of nested lists, in order. A loop, not recursion: JSON may nest
    lists a thousand deep (orjson's limit), past Python's recursion limit."""
    stack = [iter(items)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            yield x
        else:
            stack.pop()


def _requested_outputs(
    raw: Any, specs: Mapping[str, TensorSpec], model: str
) -> list[tuple[str, bool | None]]:
    if not isinstance(raw, list):
        raise InvalidArgument("field 'outputs' must be a list")
    out: list[tuple[str, bool | None]] = []
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
        out.append((name, binary))
    return out


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
    for name, binary in selection:
        arr = outputs[name]
        datatype = output_specs[name].datatype
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary if binary is not None else req.binary_default:
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
