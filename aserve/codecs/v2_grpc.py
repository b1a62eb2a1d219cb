"""KServe V2 inference requests and responses over gRPC: protobuf <-> numpy.

A tensor travels either as typed ``contents`` (one repeated field per
datatype family) or as ``raw_input_contents`` / ``raw_output_contents`` (the
binary extension's byte layout). The client chooses; the response answers
raw when the request was raw, which is what tritonclient.grpc always sends.
Validation is shared with the HTTP codec (:mod:`aserve.codecs.validate`), so
both frontends refuse the same requests with the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from aserve._proto import grpc_service_pb2 as pb
from aserve.codecs.binary import tensor_to_bytes
from aserve.codecs.datatypes import numpy_dtype
from aserve.codecs.v2 import DecodedRequest
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

# The InferTensorContents field of each datatype. FP16 has none: raw only.
CONTENTS_FIELD: Final[dict[str, str]] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_FIELDS: Final[tuple[str, ...]] = tuple(dict.fromkeys(CONTENTS_FIELD.values()))
# Narrow integer types travel widened to 32 bits on the wire.
_WIRE_DTYPE: Final[dict[str, np.dtype]] = {
    "int_contents": np.dtype(np.int32),
    "uint_contents": np.dtype(np.uint32),
}


def parameters_dict(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A protobuf parameter map as plain Python values (an unset value is None)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(value, which)
    return out


def decode_infer_request(
    msg: pb.ModelInferRequest,
    model: str,
    input_specs: Mapping[str, TensorSpec],
    output_specs: Mapping[str, TensorSpec],
    max_batch_size: int,
    variable_shapes: bool,
) -> DecodedRequest:
    """Validate one ModelInferRequest; ``binary_default`` says it came raw."""
    params = parameters_dict(msg.parameters) if msg.parameters else None
    timeout_s = request_timeout(params) if params else None
    if not msg.inputs:
        raise InvalidArgument("field 'inputs' must list at least one tensor")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but the request has "
            f"{len(msg.inputs)} inputs; give one per input, in order"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(msg.inputs):
        name = tensor.name
        tensor_params = parameters_dict(tensor.parameters) if tensor.parameters else None
        shape = list(tensor.shape)
        spec, count = check_input(name, tensor.datatype, shape, tensor_params, input_specs, model)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidArgument(
                    f"input '{name}' sets contents while the request uses raw_input_contents; "
                    "use one or the other for every input"
                )
            arr = tensor_from_bytes(
                name, spec.datatype, shape, count, raw[i], f"raw_input_contents[{i}]"
            )
        else:
            contents = tensor.contents if tensor.HasField("contents") else None
            arr = _from_contents(name, spec.datatype, shape, count, contents)
        add_input(inputs, name, arr)
    batch_size, shape_key = check_batch(inputs, input_specs, model, max_batch_size, variable_shapes)
    outputs = None
    if msg.outputs:
        outputs = []
        for out in msg.outputs:
            out_params = parameters_dict(out.parameters) if out.parameters else None
            check_output(out.name, out_params, output_specs, model)
            outputs.append((out.name, None))
    return DecodedRequest(
        inputs, batch_size, shape_key, msg.id or None, outputs, bool(raw), timeout_s, params
    )


def _from_contents(
    name: str, datatype: str, shape: list[int], count: int, contents: pb.InferTensorContents | None
) -> np.ndarray:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(
            f"input '{name}': {datatype} has no typed contents field; send it in raw_input_contents"
        )
    if contents is None:
        if count == 0:
            return np.empty(shape, dtype=numpy_dtype(datatype))
        raise InvalidArgument(
            f"input '{name}' has no data: set contents.{field} or raw_input_contents"
        )
    for other in _ALL_FIELDS:
        if other != field and len(getattr(contents, other)):
            raise InvalidArgument(
                f"input '{name}': {datatype} data goes in contents.{field}, not contents.{other}"
            )
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidArgument(
            f"input '{name}': contents.{field} has {len(values)} elements, shape {shape} needs {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr.reshape(shape)
    dtype = numpy_dtype(datatype)
    wide = np.array(values, dtype=_WIRE_DTYPE.get(field, dtype))
    if wide.dtype != dtype:
        info = np.iinfo(dtype)
        if count and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidArgument(
                f"input '{name}': contents.{field} holds a value outside {datatype}'s range "
                f"[{info.min}, {info.max}]"
            )
        wide = wide.astype(dtype)
    return wide.reshape(shape)


def encode_infer_response(
    model: str,
    version: str,
    req: DecodedRequest,
    outputs: Mapping[str, np.ndarray],
    output_specs: Mapping[str, TensorSpec],
) -> pb.ModelInferResponse:
    """The response message; raw when the request was raw or an output has no typed field.

    ``raw_output_contents`` must then cover every output, in order: clients
    index it by the output's position.
    """
    names = [n for n, _ in req.outputs] if req.outputs is not None else list(output_specs)
    raw = req.binary_default or any(output_specs[n].datatype not in CONTENTS_FIELD for n in names)
    response = pb.ModelInferResponse(
        model_name=model, model_version=version, id=req.client_id or ""
    )
    for name in names:
        arr = outputs[name]
        datatype = output_specs[name].datatype
        tensor = response.outputs.add(name=name, datatype=datatype, shape=arr.shape)
        if raw:
            response.raw_output_contents.append(tensor_to_bytes(arr))
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.extend(
                x.encode() if isinstance(x, str) else bytes(x) for x in arr.ravel()
            )
        else:
            getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(arr.ravel().tolist())
    return response
