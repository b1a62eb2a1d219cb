"""KServe V2 ``/infer`` between a frontend process and the core, over the shared-memory
rings of ``http.workers`` (codecs layer: pure, no torch, no asyncio).

A frontend decodes the request body with the HTTP codec's own functions
(:func:`~aserve.codecs.v2.from_json` for JSON data; binary tensors are sliced
as they came) but without the model's metadata, which only the core holds:
:func:`pack_request` turns the body into a header (each input's name,
datatype, shape, parameters and byte count; the requested outputs; the
request's parameters and id) and the inputs' raw bytes. It gives None for a
body it does not take (shared memory regions, or anything it cannot read):
the frontend then forwards the request whole, and the core answers it, its
errors included, as it answers any.

The core checks that header against the model exactly as the HTTP codec
checks a body (:func:`decode_packed`: the same checks of :mod:`.validate`,
the same messages); the core copied the message out of the ring once, and
the inputs are views of that copy. Its answer is :func:`pack_answer` (each output's
name, datatype, shape and byte count, then the bytes), which the frontend
turns into the V2 response with :func:`~aserve.codecs.v2.encode_response`
(:func:`encode_packed`), JSON or binary as the request asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aserve.codecs.binary import tensor_to_bytes
from aserve.codecs.shm import REGION
from aserve.codecs.v2 import (
    DecodedRequest,
    _request_parameters,
    _requested_outputs,
    encode_response,
    from_json,
    json_object,
)
from aserve.codecs.validate import add_shape, check_input, check_shapes, tensor_from_bytes
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument
from aserve.types.tensors import DATATYPES

# A packed request's header: "i" [[name, datatype, shape, parameters, bytes], ...],
# "o" the body's "outputs" as given (None: all), "p" its "parameters", "id" its "id".
Header = dict[str, Any]


@dataclass(slots=True)
class Packed:
    """A request as a frontend hands it to the core, and what it keeps to encode the answer."""

    header: Header
    tensors: list[bytes | memoryview]  # the inputs' bytes, in the header's order
    client_id: str | None
    outputs: list[tuple[str, bool | None]] | None  # requested (name, binary), None: all
    binary_default: bool


def pack_request(body: bytes, header_length: str | None) -> Packed | None:
    """``body`` (with its Inference-Header-Content-Length, if any) as a header and
    tensor bytes; None when the frontend should forward the request whole."""
    try:
        return _pack(body, header_length)
    except Exception:  # anything it cannot read: the core reads it, and says what is wrong
        return None


def _pack(body: bytes, header_length: str | None) -> Packed | None:
    binary: memoryview | None = None
    header: bytes | memoryview = body
    if header_length is not None:
        n = int(header_length)
        if n <= 0 or n > len(body):
            return None
        view = memoryview(body)
        header, binary = view[:n], view[n:]
    doc = json_object(header)
    entries: list[list[Any]] = []
    tensors: list[bytes | memoryview] = []
    offset = 0
    for item in doc["inputs"]:
        name, datatype, shape = item["name"], item["datatype"], item["shape"]
        if type(name) is not str or datatype not in DATATYPES or type(shape) is not list:
            return None
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            count *= d
        params = item.get("parameters")
        size = None
        if params is not None:
            if REGION in params:
                return None
            size = params.get("binary_data_size")
        if size is not None:
            if binary is None or type(size) is not int or size < 0:
                return None
            chunk: bytes | memoryview = binary[offset : offset + size]
            if len(chunk) != size:
                return None
            offset += size
            params = {k: v for k, v in params.items() if k != "binary_data_size"} or None
        else:
            chunk = tensor_to_bytes(from_json(name, datatype, shape, count, item["data"]))
        entries.append([name, datatype, shape, params, len(chunk)])
        tensors.append(chunk)
    if binary is not None and offset != len(binary):
        return None
    raw_outputs = doc.get("outputs")
    outputs: list[tuple[str, bool | None]] | None = None
    if raw_outputs is not None:
        outputs = []
        for item in raw_outputs:
            params = item.get("parameters") or {}
            if REGION in params:
                return None
            binary_flag = params.get("binary_data")
            if binary_flag is not None and type(binary_flag) is not bool:
                return None
            outputs.append((item["name"], binary_flag))
    params = doc.get("parameters")
    binary_default = False if params is None else params.get("binary_data_output", False)
    client_id = doc.get("id")
    if type(binary_default) is not bool or (client_id is not None and type(client_id) is not str):
        return None
    packed = {"i": entries, "o": raw_outputs, "p": params, "id": client_id}
    return Packed(packed, tensors, client_id, outputs, binary_default)


def decode_packed(
    header: Header,
    tensors: memoryview,
    model: str,
    input_specs: Mapping[str, TensorSpec],
    output_specs: Mapping[str, TensorSpec],
    max_batch_size: int,
    variable_shapes: bool,
    max_elements: int | None,
) -> DecodedRequest:
    """The core's side: a packed request checked against the model, as
    :func:`~aserve.codecs.v2.decode_request` checks a body; its inputs are views of
    ``tensors`` (which the caller copied out of the ring)."""
    params = header["p"]
    binary_default, timeout_s = False, None
    if params is not None:
        binary_default, timeout_s = _request_parameters(params)
    if not header["i"]:
        raise InvalidArgument("field 'inputs' must be a non-empty list of tensors")
    shapes: dict[str, list[int]] = {}
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for name, datatype, shape, in_params, size in header["i"]:
        _, count = check_input(
            name, datatype, shape, in_params, input_specs, model, max_batch_size, max_elements
        )
        chunk = tensors[offset : offset + size]
        offset += size
        # Read-only views of ``tensors``, as a binary body's are of the body.
        inputs[name] = tensor_from_bytes(name, datatype, shape, count, chunk, "binary_data_size")
        add_shape(shapes, name, shape)
    batch_size, shape_key = check_shapes(
        shapes, input_specs, model, max_batch_size, variable_shapes
    )
    outputs = None
    if header["o"] is not None:
        outputs, _ = _requested_outputs(header["o"], output_specs, model, batch_size, None, [])
    return DecodedRequest(
        inputs, batch_size, shape_key, header["id"], outputs, binary_default, timeout_s, params
    )


def pack_answer(
    decoded: DecodedRequest,
    outputs: Mapping[str, np.ndarray],
    output_specs: Mapping[str, TensorSpec],
) -> tuple[list[list[Any]], list[bytes]]:
    """The core's answer: [[name, datatype, shape, bytes], ...] in the order the
    response lists them, and their bytes."""
    names = [n for n, _ in decoded.outputs] if decoded.outputs is not None else list(output_specs)
    entries: list[list[Any]] = []
    chunks: list[bytes] = []
    for name in names:
        arr = outputs[name]
        raw = tensor_to_bytes(arr)
        entries.append([name, output_specs[name].datatype, list(arr.shape), len(raw)])
        chunks.append(raw)
    return entries, chunks


def encode_packed(
    model: str, version: str, packed: Packed, entries: list[list[Any]], data: memoryview
) -> tuple[bytes, int | None]:
    """The frontend's side: the V2 response body of a packed answer (and the JSON
    header's length when binary data follows), as the core's route would encode it."""
    arrays: dict[str, np.ndarray] = {}
    specs: dict[str, TensorSpec] = {}
    offset = 0
    for name, datatype, shape, size in entries:
        count = 1
        for d in shape:
            count *= d
        chunk = data[offset : offset + size]
        offset += size
        arrays[name] = tensor_from_bytes(name, datatype, shape, count, chunk, "answer")
        specs[name] = TensorSpec.model_construct(name=name, datatype=datatype, shape=[])
    outputs = packed.outputs
    if outputs is None:
        outputs = [(name, None) for name in arrays]
    req = DecodedRequest({}, 0, (), packed.client_id, outputs, packed.binary_default, None, None)
    return encode_response(model, version, req, arrays, specs)
