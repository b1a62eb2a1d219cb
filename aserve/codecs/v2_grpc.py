"""KServe V2 inference requests and responses over gRPC: protobuf <-> numpy.

A request's tensor travels either as typed ``contents`` (one repeated field
per datatype family) or in ``raw_input_contents`` (the binary extension's
byte layout), the client's choice. Every answer is raw
(``raw_output_contents``), as Triton's are: clients written against Triton's
protobuf, tritonclient.grpc among them, read only those.
Validation is shared with the HTTP codec (:mod:`aserve.codecs.validate`), so
both frontends refuse the same requests with the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final

import numpy as np

from aserve._proto import grpc_service_pb2 as pb
from aserve.codecs.binary import CHUNK, tensor_to_bytes
from aserve.codecs.shm import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    OutputTarget,
    Release,
    SharedMemory,
    acquire,
    check_room,
    release_all,
    write_output,
)
from aserve.codecs.v2 import OFF_LOOP_ELEMENTS, DecodedRequest
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
    *,
    max_elements: int | None = None,
    defer: bool = False,
    shm: SharedMemory | None = None,
) -> DecodedRequest:
    """Validate one ModelInferRequest. ``binary_default`` is always true: every
    gRPC answer is raw, whichever form the request's tensors came in.

    ``max_elements``, ``defer`` and ``shm`` as for
    :func:`aserve.codecs.v2.decode_request`: with ``defer``, tensors of many
    elements are left in ``pending``. ``raw_input_contents`` holds one entry per
    input that is not in shared memory, in order (what tritonclient sends).
    """
    held: list[Release] = []
    try:
        return _decode(
            msg, model, input_specs, output_specs, max_batch_size, variable_shapes,
            max_elements, defer, shm, held,
        )  # fmt: skip
    except BaseException:
        release_all(held)
        raise


def _decode(
    msg: pb.ModelInferRequest,
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
    params = parameters_dict(msg.parameters) if msg.parameters else None
    timeout_s = request_timeout(params) if params else None
    if not msg.inputs:
        raise InvalidArgument("field 'inputs' must list at least one tensor")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        in_shm = sum(REGION in t.parameters for t in msg.inputs)
        if len(raw) != len(msg.inputs) - in_shm:
            raise InvalidArgument(
                f"raw_input_contents has {len(raw)} entries but the request has "
                f"{len(msg.inputs) - in_shm} inputs not in shared memory; give one per "
                "input, in order"
            )
    next_raw = 0  # the raw_input_contents entry of the next input not in shared memory
    shapes: dict[str, list[int]] = {}
    inputs: dict[str, np.ndarray] = {}
    pending: list[tuple[str, Callable[[], np.ndarray]]] = []
    heavy = False
    for tensor in msg.inputs:
        name = tensor.name
        tensor_params = parameters_dict(tensor.parameters) if tensor.parameters else None
        shape = list(tensor.shape)
        spec, count = check_input(
            name, tensor.datatype, shape, tensor_params, input_specs, model, max_batch_size,
            max_elements,
        )  # fmt: skip
        job: Callable[[], np.ndarray]
        if tensor_params is not None and REGION in tensor_params:
            region, _, view = acquire(shm, tensor_params, f"input '{name}'", held)
            if tensor.HasField("contents"):
                raise InvalidArgument(
                    f"input '{name}' of model '{model}' names a shared memory region and also "
                    "sets contents; give one or the other"
                )
            # Read in place: a read-only view, so that no model writes into the client's memory.
            job = partial(
                tensor_from_bytes, name, spec.datatype, shape, count, view.toreadonly(),
                f"shared memory (region '{region}')",
            )  # fmt: skip
            big = count > OFF_LOOP_ELEMENTS and spec.datatype in ("BYTES", "BOOL")
        elif raw:
            if next_raw == len(raw):
                raise InvalidArgument(
                    f"input '{name}' has no raw_input_contents entry (there are {len(raw)}); "
                    "give one per input not in shared memory, in order"
                )
            if tensor.HasField("contents"):
                raise InvalidArgument(
                    f"input '{name}' of model '{model}' is given both as typed contents and "
                    "in raw_input_contents; give it one way (a request with raw_input_contents "
                    "has every input not in shared memory there)"
                )
            job = partial(
                tensor_from_bytes, name, spec.datatype, shape, count, raw[next_raw],
                f"raw_input_contents[{next_raw}]",
            )  # fmt: skip
            next_raw += 1
            big = count > OFF_LOOP_ELEMENTS and spec.datatype in ("BYTES", "BOOL")
        else:
            contents = tensor.contents if tensor.HasField("contents") else None
            job = _contents_job(name, spec.datatype, shape, count, contents)
            big = count > OFF_LOOP_ELEMENTS
        add_shape(shapes, name, shape)
        if heavy or (defer and big):
            heavy = True  # this input and the rest wait for the worker thread
            pending.append((name, job))
        else:
            inputs[name] = job()
    if raw and next_raw != len(raw):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but {next_raw} inputs not in "
            "shared memory; give one per input not in shared memory, in order"
        )
    batch_size, shape_key = check_shapes(
        shapes, input_specs, model, max_batch_size, variable_shapes
    )
    outputs = targets = None
    if msg.outputs:
        outputs = []
        for out in msg.outputs:
            out_params = parameters_dict(out.parameters) if out.parameters else None
            check_output(out.name, out_params, output_specs, model)
            if out_params is not None and REGION in out_params:
                region, offset, view = acquire(shm, out_params, f"output '{out.name}'", held)
                targets = targets or {}
                target = targets[out.name] = OutputTarget(region, offset, view)
                spec = output_specs[out.name]
                check_room(out.name, spec.datatype, [batch_size, *spec.shape], target)
            outputs.append((out.name, None))
    return DecodedRequest(
        inputs, batch_size, shape_key, msg.id or None, outputs, True, timeout_s,
        params, pending, targets, held,
    )  # fmt: skip


def _contents_job(
    name: str, datatype: str, shape: list[int], count: int, contents: pb.InferTensorContents | None
) -> Callable[[], np.ndarray]:
    """Check typed contents against the shape now (cheap); returns what converts them."""
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(
            f"input '{name}': {datatype} has no typed contents field; send it in raw_input_contents"
        )
    if contents is None:
        if count == 0:
            return partial(np.empty, shape, dtype=numpy_dtype(datatype))
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
    return partial(_from_contents, name, datatype, shape, count, field, values)


def _from_contents(
    name: str, datatype: str, shape: list[int], count: int, field: str, values: Any
) -> np.ndarray:
    """Convert typed contents, a chunk at a time (large ones run on a worker thread)."""
    dtype = numpy_dtype(datatype)
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        for i in range(0, count, CHUNK):
            arr[i : i + CHUNK] = list(values[i : i + CHUNK])
        return arr.reshape(shape)
    wide = np.empty(count, dtype=_WIRE_DTYPE.get(field, dtype))
    if count <= CHUNK:
        wide[:] = values
    else:
        for i in range(0, count, CHUNK):
            wide[i : i + CHUNK] = values[i : i + CHUNK]
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
    """The response message, every output in ``raw_output_contents``.

    ``raw_output_contents`` covers every output, in order (an output written
    into shared memory has an empty entry): clients index it by the output's
    position.
    """
    names = [n for n, _ in req.outputs] if req.outputs is not None else list(output_specs)
    response = pb.ModelInferResponse(
        model_name=model, model_version=version, id=req.client_id or ""
    )
    targets = req.shm_outputs
    raw = response.raw_output_contents
    for name in names:
        arr = outputs[name]
        tensor = response.outputs.add(
            name=name, datatype=output_specs[name].datatype, shape=arr.shape
        )
        target = targets.get(name) if targets else None
        if target is None:
            raw.append(tensor_to_bytes(arr))
            continue
        # Written into the client's region; the answer says where.
        written = write_output(name, arr, target)
        tensor.parameters[REGION].string_param = target.region
        tensor.parameters[BYTE_SIZE].int64_param = written
        if target.offset:
            tensor.parameters[OFFSET].int64_param = target.offset
        raw.append(b"")
    return response
