"""KServe V2 codec: every datatype both ways, binary layout, validation messages."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from aserve.codecs.binary import bytes_elements, tensor_to_bytes
from aserve.codecs.v2 import decode_request, encode_response
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument, Unimplemented

NUMERIC = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}  # fmt: skip


def specs(datatype, shape=(2,)):
    return {"T": TensorSpec(name="T", datatype=datatype, shape=list(shape))}


def decode(body, specs_in, ihcl=None, max_batch=8, outs=None):
    return decode_request(body, ihcl, "m", specs_in, outs or specs_in, max_batch, False)


def sample(datatype, shape):
    if datatype == "BOOL":
        return np.arange(np.prod(shape)).reshape(shape) % 2 == 0
    if datatype == "BYTES":
        arr = np.empty(shape, dtype=object)
        arr.ravel()[:] = [f"s{i}".encode() * (i + 1) for i in range(arr.size)]
        return arr
    return (np.arange(np.prod(shape)) * 3 + 1).reshape(shape).astype(NUMERIC[datatype])


@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_roundtrip_every_datatype(datatype, binary):
    arr = sample(datatype, (3, 2))
    entry = {"name": "T", "shape": [3, 2], "datatype": datatype}
    if binary:
        raw = tensor_to_bytes(arr)
        entry["parameters"] = {"binary_data_size": len(raw)}
        header = orjson.dumps({"inputs": [entry]})
        req = decode(header + raw, specs(datatype), ihcl=str(len(header)))
    else:
        data = [x.decode() for x in arr.ravel()] if datatype == "BYTES" else arr.tolist()
        entry["data"] = data
        req = decode(
            orjson.dumps({"inputs": [entry]}, option=orjson.OPT_SERIALIZE_NUMPY), specs(datatype)
        )
    got = req.inputs["T"]
    assert got.shape == (3, 2) and req.batch_size == 3
    np.testing.assert_array_equal(got, arr)

    req.binary_default = binary
    body, json_len = encode_response("m", "1", req, {"T": got}, specs(datatype))
    if binary:
        doc = orjson.loads(body[:json_len])
        out = doc["outputs"][0]
        assert "data" not in out
        assert out["parameters"]["binary_data_size"] == len(body) - json_len
        back = (bytes_elements(memoryview(body[json_len:]), 6) if datatype == "BYTES"
                else np.frombuffer(body[json_len:], NUMERIC[datatype]))  # fmt: skip
    else:
        assert json_len is None
        out = orjson.loads(body)["outputs"][0]
        back = out["data"]
        if datatype == "BYTES":
            back = [s.encode() for s in back]
    assert out["shape"] == [3, 2] and out["datatype"] == datatype
    np.testing.assert_array_equal(np.array(back, dtype=arr.dtype).reshape(3, 2), arr)


def test_bytes_binary_layout_matches_the_spec_example():
    arr = np.array([b"ab", b"xyz"], dtype=object)
    assert tensor_to_bytes(arr) == bytes.fromhex("02000000 6162 03000000 78797a".replace(" ", ""))


def test_nested_json_data_is_accepted():
    body = orjson.dumps({"inputs": [{"name": "T", "shape": [2, 2], "datatype": "INT32",
                                     "data": [[1, 2], [3, 4]]}]})  # fmt: skip
    np.testing.assert_array_equal(decode(body, specs("INT32")).inputs["T"], [[1, 2], [3, 4]])


def test_binary_and_json_inputs_mixed_in_order():
    s = {"A": TensorSpec(name="A", datatype="FP32", shape=[2]),
         "B": TensorSpec(name="B", datatype="INT64", shape=[2]),
         "C": TensorSpec(name="C", datatype="BYTES", shape=[1])}  # fmt: skip
    a, c = np.array([[1.5, 2.5]], np.float32), np.array([[b"\xff\x00"]], dtype=object)
    ra, rc = tensor_to_bytes(a), tensor_to_bytes(c)
    header = orjson.dumps({"inputs": [
        {"name": "A", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": len(ra)}},
        {"name": "B", "shape": [1, 2], "datatype": "INT64", "data": [7, 8]},
        {"name": "C", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(rc)}},
    ]})  # fmt: skip
    req = decode(header + ra + rc, s, ihcl=str(len(header)))
    np.testing.assert_array_equal(req.inputs["A"], a)
    np.testing.assert_array_equal(req.inputs["B"], [[7, 8]])
    assert req.inputs["C"][0, 0] == b"\xff\x00"


def test_output_selection_per_output_binary_flag():
    s = {"X": TensorSpec(name="X", datatype="FP32", shape=[2]),
         "Y": TensorSpec(name="Y", datatype="FP32", shape=[2])}  # fmt: skip
    body = orjson.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
                         "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]})  # fmt: skip
    req = decode_request(body, None, "m", {"X": s["X"]}, s, 4, False)
    outputs = {"X": np.array([[1, 2]], np.float32), "Y": np.array([[3, 4]], np.float32)}
    payload, json_len = encode_response("m", "1", req, outputs, s)
    doc = orjson.loads(payload[:json_len])
    assert [o["name"] for o in doc["outputs"]] == ["Y"]
    assert np.frombuffer(payload[json_len:], np.float32).tolist() == [3.0, 4.0]


@pytest.mark.parametrize(("body", "ihcl", "words"), [
    (b'{"inputs":[{"name":"T","shape":[1,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}',
     None, ["binary_data_size", "Inference-Header-Content-Length"]),
    (b"{}", "abc", ["Inference-Header-Content-Length", "abc"]),
    (b"{}", "0", ["raw binary"]),
    (b"{}", "99", ["outside the body"]),
    (b'{"inputs":[{"name":"T","shape":[1,2],"datatype":"BYTES","parameters":{"binary_data_size":11}}]}'
     + b"\x01\x00\x00\x00a\x05\x00\x00\x00ab", "98", ["T", "BYTES", "element 1"]),
    (b'{"inputs":[{"name":"T","shape":[1,2],"datatype":"BYTES","parameters":{"binary_data_size":6}}]}'
     + b"\x05\x00\x00\x00ab", "98", ["T", "BYTES", "too short for 2 elements"]),
])  # fmt: skip
def test_binary_framing_errors(body, ihcl, words):
    if ihcl == "98":  # the JSON header ends where the binary data starts
        ihcl = str(body.index(b"}]}") + 3)
    with pytest.raises(InvalidArgument) as exc:
        decode(body, specs("BYTES" if b"BYTES" in body else "FP32"), ihcl=ihcl)
    for w in words:
        assert w in exc.value.message


def test_unsupported_features_are_unimplemented_not_ignored():
    base = {"name": "T", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}
    with pytest.raises(Unimplemented, match="sequence"):
        decode(orjson.dumps({"inputs": [base], "parameters": {"sequence_id": 4}}), specs("FP32"))
    with pytest.raises(Unimplemented, match="classification"):
        decode(orjson.dumps({"inputs": [base], "outputs": [{"name": "T", "parameters": {"classification": 2}}]}),
               specs("FP32"))  # fmt: skip
    shm = {**base, "parameters": {"shared_memory_region": "r"}}
    with pytest.raises(Unimplemented, match="shared memory"):
        decode(orjson.dumps({"inputs": [shm]}), specs("FP32"))


def test_non_utf8_bytes_output_in_json_asks_for_binary():
    s = specs("BYTES", (1,))
    body = orjson.dumps(
        {"inputs": [{"name": "T", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}]}
    )
    req = decode(body, s)
    bad = np.array([[b"\xff"]], dtype=object)
    with pytest.raises(InvalidArgument, match="binary_data"):
        encode_response("m", "1", req, {"T": bad}, s)


def test_triton_timeout_parameter_is_microseconds():
    body = orjson.dumps({"inputs": [{"name": "T", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
                         "parameters": {"timeout": 250000}})  # fmt: skip
    assert decode(body, specs("FP32")).timeout_s == pytest.approx(0.25)


def test_bytes_shape_that_lies_is_refused_before_allocating():
    header = orjson.dumps({"inputs": [{"name": "T", "shape": [1, 10**11], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": 8}}]})  # fmt: skip
    with pytest.raises(InvalidArgument, match="too short"):
        decode(header + b"\x00" * 8, specs("BYTES", (-1,)), ihcl=str(len(header)))


def test_bytes_data_nested_a_thousand_deep_is_refused_not_a_recursion_error():
    # orjson reads lists nested up to 1024 deep; flattening them once recursed (a 500).
    data = b"[" * 1015 + b'"a", "b", [["c"]]' + b"]" * 1015
    body = (
        b'{"inputs": [{"name": "T", "shape": [1, 2], "datatype": "BYTES", "data": ' + data + b"}]}"
    )
    with pytest.raises(InvalidArgument, match="has more than 2 elements, shape"):
        decode(body, specs("BYTES"))
