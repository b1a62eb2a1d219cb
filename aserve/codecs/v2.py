"""KServe V2 inference requests and responses over HTTP: JSON plus binary tensors.

Decoding validates everything a request can get wrong (names, datatypes,
shapes, sizes, parameters) and raises :class:`aserve.errors.AserveError`
subclasses whose messages name the tensor or field, so a bad request never
reaches a queue. Encoding honours ``binary_data`` per output and the request's
``binary_data_output`` default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import orjson

from aserve.codecs.binary import tensor_to_bytes
from aserve.codecs.json_data import from_json
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

    def decode_pending(self) -> None:
        """Decode what ``pending`` holds into ``inputs`` (raises the data's errors)."""
        for name, decode in self.pending:
            self.inputs[name] = decode()
        self.pending = []


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
) -> DecodedRequest:
    """Parse and validate one ``/infer`` body.

    ``max_elements`` is ``limits.max_tensor_elements``. With ``defer``, data
    that is much work to decode is left in ``pending`` (see
    :class:`DecodedRequest`); without it, everything is decoded here.
    """
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
    shapes: dict[str, list[int]] = {}
    inputs: dict[str, np.ndarray] = {}
    pending: list[tuple[str, Callable[[], np.ndarray]]] = []
    heavy = defer and len(header) > OFF_LOOP_JSON_BYTES
    offset = 0
    for i, item in enumerate(raw_inputs):
        name, shape, decode, used, big = _decode_input(
            i, item, input_specs, binary, offset, model, max_batch_size, max_elements
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

    outputs = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        outputs = _requested_outputs(raw_outputs, output_specs, model)
    return DecodedRequest(
        inputs, batch_size, shape_key, client_id, outputs, binary_default, timeout_s, params,
        pending,
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
