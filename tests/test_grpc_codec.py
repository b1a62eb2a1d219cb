"""The gRPC tensor codec against tritonclient's own messages (no server).

Requests are built with tritonclient.grpc's classes and crossed over the wire
format (serialize with theirs, parse with ours); responses go the other way
and are read back with tritonclient's ``InferResult``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2 as tpb

from aserve._proto import grpc_service_pb2 as pb
from aserve.codecs.v2 import OFF_LOOP_ELEMENTS
from aserve.codecs.v2_grpc import CONTENTS_FIELD, decode_infer_request, encode_infer_response
from aserve.config import TensorSpec
from aserve.errors import AserveError, ErrorCode

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES"]  # fmt: skip


def _array(datatype: str, rng: np.random.Generator, shape=(2, 3)) -> np.ndarray:
    if datatype == "BYTES":
        words = [b"", b"a", "\u00e9t\u00e9".encode(), b"\x00\xff\xfe", b"xyz" * 50, b"k"]
        return np.array(words, dtype=object).reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    dtype = np.dtype(tc.triton_to_np_dtype(datatype))
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def _specs(prefix: str, datatypes: list[str]) -> dict[str, TensorSpec]:
    return {
        f"{prefix}_{t}": TensorSpec(name=f"{prefix}_{t}", datatype=t, shape=[3]) for t in datatypes
    }


def _raw_request(arrays: dict[str, np.ndarray], **fields) -> pb.ModelInferRequest:
    """What tritonclient.grpc sends: raw_input_contents, built by its own classes."""
    theirs = tpb.ModelInferRequest(model_name="m", **fields)
    for name, arr in arrays.items():
        inp = tc.InferInput(name, list(arr.shape), tc.np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        theirs.inputs.append(inp._get_tensor())
        theirs.raw_input_contents.append(inp._get_content())
    return pb.ModelInferRequest.FromString(theirs.SerializeToString())


def _typed_request(
    arrays: dict[str, np.ndarray], datatypes: dict[str, str]
) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    for name, arr in arrays.items():
        t = req.inputs.add(name=name, datatype=datatypes[name], shape=arr.shape)
        field = getattr(t.contents, CONTENTS_FIELD[datatypes[name]])
        field.extend(list(arr.ravel()) if arr.dtype.kind == "O" else arr.ravel().tolist())
    return req


def _decode(req: pb.ModelInferRequest, specs: dict[str, TensorSpec], outputs=None, max_batch=8):
    return decode_infer_request(req, "m", specs, outputs or specs, max_batch, False)


def _their_result(response: pb.ModelInferResponse) -> tc.InferResult:
    return tc.InferResult(tpb.ModelInferResponse.FromString(response.SerializeToString()))


def test_raw_request_of_every_datatype_decodes_and_answers_raw():
    rng = np.random.default_rng(0)
    specs = _specs("IN", DATATYPES)
    arrays = {name: _array(s.datatype, rng) for name, s in specs.items()}
    decoded = _decode(_raw_request(arrays, id="r-7"), specs)
    assert decoded.batch_size == 2 and decoded.client_id == "r-7"
    assert decoded.binary_default, "every answer is raw"
    for name, want in arrays.items():
        got = decoded.inputs[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)

    response = encode_infer_response("m", "1", decoded, decoded.inputs, specs)
    assert response.id == "r-7" and response.model_version == "1"
    assert len(response.raw_output_contents) == len(specs)
    result = _their_result(response)
    for name, want in arrays.items():
        np.testing.assert_array_equal(result.as_numpy(name), want, err_msg=name)


def test_typed_request_decodes_and_is_answered_raw():
    """Every answer is raw, as Triton's are: clients written against its protobuf read only that."""
    rng = np.random.default_rng(1)
    typed = [t for t in DATATYPES if t != "FP16"]
    specs = _specs("IN", typed)
    arrays = {name: _array(s.datatype, rng) for name, s in specs.items()}
    decoded = _decode(_typed_request(arrays, {n: s.datatype for n, s in specs.items()}), specs)
    for name, want in arrays.items():
        assert decoded.inputs[name].dtype == want.dtype, name
        np.testing.assert_array_equal(decoded.inputs[name], want, err_msg=name)

    response = encode_infer_response("m", "1", decoded, decoded.inputs, specs)
    assert len(response.raw_output_contents) == len(specs)
    assert not any(t.HasField("contents") for t in response.outputs)
    result = _their_result(response)
    for tensor in response.outputs:
        want = arrays[tensor.name]
        assert list(tensor.shape) == list(want.shape)
        np.testing.assert_array_equal(result.as_numpy(tensor.name), want, err_msg=tensor.name)


def test_typed_request_with_an_fp16_output_is_answered_raw_for_every_output():
    specs = _specs("IN", ["FP32"])
    outputs = _specs("OUT", ["FP32", "FP16"])
    x = np.ones((1, 3), np.float32)
    decoded = _decode(_typed_request({"IN_FP32": x}, {"IN_FP32": "FP32"}), specs, outputs)
    answer = {"OUT_FP32": x, "OUT_FP16": x.astype(np.float16)}
    response = encode_infer_response("m", "1", decoded, answer, outputs)
    assert len(response.raw_output_contents) == 2, "raw must cover every output, in order"
    result = _their_result(response)
    np.testing.assert_array_equal(result.as_numpy("OUT_FP16"), answer["OUT_FP16"])
    np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), x)


def test_requested_outputs_keep_their_order_and_parameters_are_read():
    specs = _specs("IN", ["FP32"])
    outputs = _specs("OUT", ["FP32", "INT64"])
    req = _raw_request({"IN_FP32": np.ones((1, 3), np.float32)})
    req.outputs.add(name="OUT_INT64")
    req.parameters["timeout"].int64_param = 250_000  # Triton's spelling: microseconds
    req.parameters["priority"].uint64_param = 1
    decoded = _decode(req, specs, outputs)
    assert decoded.outputs == [("OUT_INT64", None)]
    assert decoded.timeout_s == pytest.approx(0.25)
    answer = {"OUT_FP32": np.zeros((1, 3), np.float32), "OUT_INT64": np.arange(3)[None]}
    response = encode_infer_response("m", "1", decoded, answer, outputs)
    assert [o.name for o in response.outputs] == ["OUT_INT64"]
    np.testing.assert_array_equal(_their_result(response).as_numpy("OUT_INT64"), [[0, 1, 2]])


def _bad(mutate):
    """A valid raw request for model inputs A (FP32 [3]) and S (BYTES [1]), then ``mutate``."""
    req = _raw_request({"A": np.ones((1, 3), np.float32), "S": np.array([[b"hi"]], dtype=object)})
    mutate(req)
    return req


def _typed_a(values, field="fp32_contents", datatype="FP32", shape=(1, 3)):
    def mutate(req):
        del req.raw_input_contents[:]
        a, s = req.inputs
        a.datatype = datatype
        a.ClearField("shape")
        a.shape.extend(shape)
        if values is not None:
            getattr(a.contents, field).extend(values)
        s.contents.bytes_contents.append(b"hi")

    return mutate


def _duplicate_a(req):
    req.inputs.add().CopyFrom(req.inputs[0])
    req.raw_input_contents.append(req.raw_input_contents[0])


def _two_rows_of_s(req):
    req.inputs[1].shape[0] = 2
    req.raw_input_contents[1] = b"\2\0\0\0hi" * 2


def _classification(req):
    req.outputs.add(name="A").parameters["classification"].int64_param = 3


BAD = [
    # (case, mutate, error code, words the message must contain)
    ("no inputs", lambda r: (r.ClearField("inputs"), r.ClearField("raw_input_contents")),
     ErrorCode.INVALID_ARGUMENT, ["inputs"]),
    ("unknown input", lambda r: setattr(r.inputs[0], "name", "NOPE"), ErrorCode.INVALID_ARGUMENT, ["NOPE", "A, S"]),
    ("wrong datatype", lambda r: setattr(r.inputs[0], "datatype", "INT32"), ErrorCode.INVALID_ARGUMENT,
     ["'A'", "INT32", "FP32"]),
    ("wrong shape", lambda r: r.inputs[0].shape.append(1), ErrorCode.INVALID_ARGUMENT, ["'A'", "shape"]),
    ("raw count", lambda r: r.raw_input_contents.append(b""), ErrorCode.INVALID_ARGUMENT,
     ["raw_input_contents", "3 entries", "2 inputs"]),
    ("raw and typed", lambda r: r.inputs[0].contents.fp32_contents.extend([1, 2, 3]),
     ErrorCode.INVALID_ARGUMENT, ["input 'A' of model 'm'", "both", "typed contents", "raw_input_contents"]),
    ("raw size", lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 8), ErrorCode.INVALID_ARGUMENT,
     ["'A'", "raw_input_contents[0]", "8 bytes", "12"]),
    ("raw bytes prefix", lambda r: r.raw_input_contents.__setitem__(1, b"\x09\0\0\0hi"),
     ErrorCode.INVALID_ARGUMENT, ["'S'", "BYTES", "raw_input_contents[1]", "element 0"]),
    ("typed field", _typed_a([1, 2, 3], field="int_contents"), ErrorCode.INVALID_ARGUMENT,
     ["'A'", "fp32_contents", "int_contents"]),
    ("typed count", _typed_a([1.0, 2.0]), ErrorCode.INVALID_ARGUMENT, ["'A'", "2 elements", "needs 3"]),
    ("typed no data", _typed_a(None), ErrorCode.INVALID_ARGUMENT, ["'A'", "no data", "fp32_contents"]),
    ("duplicate", _duplicate_a, ErrorCode.INVALID_ARGUMENT, ["'A'", "more than once"]),
    ("missing", lambda r: (r.inputs.pop(), r.raw_input_contents.pop()), ErrorCode.INVALID_ARGUMENT,
     ["missing input", "S"]),
    ("batch mismatch", _two_rows_of_s, ErrorCode.INVALID_ARGUMENT, ["batch size 2", "other inputs have 1"]),
    ("unknown output", lambda r: r.outputs.add(name="ZZ"), ErrorCode.INVALID_ARGUMENT, ["ZZ", "outputs: A, S"]),
    ("classification", _classification, ErrorCode.UNIMPLEMENTED, ["'A'", "classification"]),
    ("bad timeout", lambda r: setattr(r.parameters["timeout"], "int64_param", -1), ErrorCode.INVALID_ARGUMENT,
     ["timeout", "positive"]),
    ("shared memory", lambda r: setattr(r.inputs[0].parameters["shared_memory_region"], "string_param", "x"),
     ErrorCode.UNIMPLEMENTED, ["'A'", "shared memory"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "code", "words"), BAD, ids=[c[0] for c in BAD])
def test_bad_request_raises_its_code_with_a_message_naming_it(case, mutate, code, words):
    specs = {"A": TensorSpec(name="A", datatype="FP32", shape=[3]),
             "S": TensorSpec(name="S", datatype="BYTES", shape=[1])}  # fmt: skip
    with pytest.raises(Exception) as exc:
        _decode(_bad(mutate), specs)
    assert getattr(exc.value, "code", None) is code, f"{case}: {exc.value!r}"
    for word in words:
        assert word in exc.value.message, f"{case}: {word!r} not in {exc.value.message!r}"


@pytest.mark.parametrize(
    ("datatype", "field", "value"),
    [
        ("INT8", "int_contents", 200),
        ("UINT16", "uint_contents", 70000),
        ("INT16", "int_contents", -40000),
    ],
)
def test_typed_narrow_integers_out_of_range_are_refused(datatype, field, value):
    specs = {"A": TensorSpec(name="A", datatype=datatype, shape=[2])}
    req = pb.ModelInferRequest(model_name="m")
    getattr(req.inputs.add(name="A", datatype=datatype, shape=[1, 2]).contents, field).extend(
        [1, value]
    )
    with pytest.raises(Exception) as exc:
        _decode(req, specs)
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert (
        "'A'" in exc.value.message
        and datatype in exc.value.message
        and "range" in exc.value.message
    )


def test_fp16_cannot_travel_typed():
    specs = {"H": TensorSpec(name="H", datatype="FP16", shape=[1])}
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="H", datatype="FP16", shape=[1, 1]).contents.fp32_contents.append(1.0)
    with pytest.raises(Exception) as exc:
        _decode(req, specs)
    assert "'H'" in exc.value.message and "raw_input_contents" in exc.value.message


# --- shapes, limits and large tensors ------------------------------------------------------


def _one_input(datatype: str, shape: list[int], spec_shape: list[int]) -> tuple[Any, Any]:
    specs = {"X": TensorSpec(name="X", datatype=datatype, shape=spec_shape)}
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="X", datatype=datatype, shape=shape)
    return req, specs


@pytest.mark.parametrize(
    "shape,words",
    [
        ([0, 2**63 - 1], "too large for a tensor"),
        ([0, 2**62], "too large for a tensor"),
        ([1, -3], "dimension 1 of shape [1, -3] is -3"),
        ([-(2**63), 1], "must not be negative"),
    ],
)
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_impossible_shapes_are_invalid_argument(shape, words, raw):
    req, specs = _one_input("FP32", shape, [-1])
    if raw:
        req.raw_input_contents.append(b"")
    with pytest.raises(AserveError) as refused:
        _decode(req, specs)
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT
    assert "input 'X'" in refused.value.message and words in refused.value.message


def test_the_element_limit_comes_from_the_declared_shape_before_decoding():
    req, specs = _one_input("BYTES", [1, 10**9], [-1])
    req.raw_input_contents.append(b"\x00" * 8)
    with pytest.raises(AserveError) as refused:
        decode_infer_request(req, "m", specs, specs, 8, False, max_elements=1000)
    assert refused.value.code is ErrorCode.TOO_LARGE
    assert refused.value.message.startswith("input 'X' has 1000000000 elements (shape [1, ")


@pytest.mark.parametrize("datatype", ["FP32", "INT8", "BYTES", "BOOL", "UINT64"])
def test_large_typed_contents_are_deferred_and_decode_exactly(datatype):
    count = OFF_LOOP_ELEMENTS * 5 + 3  # several chunks
    if datatype == "BYTES":
        want = np.array([b"e%d" % i for i in range(count)], dtype=object)
    else:
        want = _array(datatype, np.random.default_rng(3), shape=(count,))
    req, specs = _one_input(datatype, [1, count], [-1])
    field = getattr(req.inputs[0].contents, CONTENTS_FIELD[datatype])
    field.extend(want.tolist())
    decoded = decode_infer_request(req, "m", specs, specs, 8, False, defer=True)
    assert [name for name, _ in decoded.pending] == ["X"] and decoded.batch_size == 1
    decoded.decode_pending()
    got = decoded.inputs["X"]
    assert got.shape == (1, count) and got.dtype == want.dtype
    np.testing.assert_array_equal(got.ravel(), want)


def test_large_typed_narrow_integers_out_of_range_are_refused_in_any_chunk():
    count = OFF_LOOP_ELEMENTS * 5
    req, specs = _one_input("INT8", [1, count], [-1])
    values = [1] * count
    values[-1] = 300
    req.inputs[0].contents.int_contents.extend(values)
    decoded = decode_infer_request(req, "m", specs, specs, 8, False, defer=True)
    with pytest.raises(AserveError, match="outside INT8's range"):
        decoded.decode_pending()


def test_raw_bool_bytes_must_be_zero_or_one():
    req, specs = _one_input("BOOL", [1, 3], [3])
    req.raw_input_contents.append(b"\x00\x01\x07")
    with pytest.raises(AserveError, match=r"BOOL raw_input_contents\[0\] byte 2 is 7"):
        _decode(req, specs)
