"""KServe V2 codec: every datatype both ways, binary layout, validation messages."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from aserve.codecs.binary import CHUNK, bytes_elements, tensor_to_bytes
from aserve.codecs.v2 import OFF_LOOP_ELEMENTS, decode_request, encode_response
from aserve.config import TensorSpec
from aserve.errors import InvalidArgument, TooLarge, Unimplemented

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
    # The sequence parameters pass through to the model, which reads or refuses them.
    seq = {"sequence_id": 4, "sequence_start": True}
    assert (
        decode(orjson.dumps({"inputs": [base], "parameters": seq}), specs("FP32")).parameters == seq
    )
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


# --- BYTES elements: the uniform fast path, the scan, chunks ---------------------------


def _bytes_wire(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


@pytest.mark.parametrize(
    "items",
    [
        [b""] * (CHUNK * 2 + 5),  # the zero-length bomb, over several chunks
        [b"a\x00\x00"] * (CHUNK + 1),  # one width, trailing NULs kept
        [bytes([i % 256, 0]) for i in range(CHUNK + 7)],
        [b"x" * (i % 4) for i in range(CHUNK * 2 + 3)],  # varied lengths: the scan
        [b"ab", b"", b"abcd"],  # the first length times the count fits, the rest differ
        [b"a", b"bc", b""],
        [b"\x01\x00\x00\x00"] * 4,  # elements that look like length prefixes
    ],
    ids=["zero-length", "nul-padded", "two-byte", "varied", "uneven", "mixed", "lookalike"],
)
def test_bytes_elements_decode_exactly(items):
    got = bytes_elements(memoryview(_bytes_wire(items)), len(items))
    assert got.dtype == object and got.tolist() == items


@pytest.mark.parametrize(
    "raw,count,words",
    [
        (b"\x00" * 7, 2, "too short for 2 elements"),
        (b"\x00" * 12, 2, "4 bytes left over after 2 elements"),
        (struct.pack("<I", 9) + b"abc", 1, "element 0 declares 9 bytes but only 3 remain"),
        (
            struct.pack("<I", 3) + b"abc" + b"\x00" * 2,
            2,
            "ends inside the length prefix of element 1",
        ),
        (b"\x00" * 4, 0, "4 bytes left over after 0 elements"),
    ],
)
def test_bytes_elements_errors_name_the_element(raw, count, words):
    with pytest.raises(ValueError, match=words):
        bytes_elements(memoryview(raw), count)


def _binary(datatype, shape, raw, spec_shape=(-1,), **kw):
    header = orjson.dumps({"inputs": [{"name": "T", "shape": shape, "datatype": datatype,
                                       "parameters": {"binary_data_size": len(raw)}}]})  # fmt: skip
    return decode_request(
        header + raw, str(len(header)), "m", specs(datatype, spec_shape),
        specs(datatype, spec_shape), 8, False, **kw,
    )  # fmt: skip


def test_a_large_bytes_tensor_is_left_for_a_worker_thread_when_deferred():
    items = [b"q"] * (OFF_LOOP_ELEMENTS + 1)
    raw = _bytes_wire(items)
    req = _binary("BYTES", [1, len(items)], raw, defer=True)
    assert not req.inputs and [name for name, _ in req.pending] == ["T"]
    assert req.batch_size == 1  # everything but the data was checked already
    req.decode_pending()
    assert not req.pending and req.inputs["T"].shape == (1, len(items))
    # Without defer (and small ones always) it is decoded at once.
    assert _binary("BYTES", [1, len(items)], raw).inputs["T"].ravel().tolist() == items
    assert not _binary("BYTES", [1, 3], _bytes_wire([b"a"] * 3), defer=True).pending


def test_deferred_data_errors_are_raised_by_decode_pending():
    count = OFF_LOOP_ELEMENTS + 1
    req = _binary("BYTES", [1, count], b"\x00" * (4 * count + 3), defer=True)
    with pytest.raises(InvalidArgument, match="3 bytes left over"):
        req.decode_pending()


def test_the_element_limit_comes_from_the_declared_shape_before_decoding():
    # 10**9 elements declared, 8 bytes sent: the limit answers, not the data.
    with pytest.raises(TooLarge, match=r"input 'T' has 1000000000 elements \(shape \[1, "):
        _binary("BYTES", [1, 10**9], b"\x00" * 8, max_elements=1000)
    with pytest.raises(InvalidArgument, match="batch size 9 exceeds max_batch_size 8"):
        _binary("BYTES", [9, 10**8], b"\x00" * 8, spec_shape=(-1,))


def test_binary_bool_bytes_must_be_zero_or_one():
    with pytest.raises(InvalidArgument, match="BOOL binary_data_size byte 1 is 2"):
        _binary("BOOL", [1, 3], b"\x01\x02\x00")
    assert _binary("BOOL", [1, 3], b"\x01\x00\x01").inputs["T"].tolist() == [[True, False, True]]


# --- shapes no tensor can have ----------------------------------------------------------


@pytest.mark.parametrize(
    "shape,words",
    [
        ([0, 2**63 - 1], "too large for a tensor"),
        ([0, 2**64 - 1], "too large for a tensor"),
        ([0, 2**62], "too large for a tensor"),
        ([1, 2**61], "too large for a tensor"),
        ([3, -2], "dimension 1 of shape [3, -2] is -2"),
        ([-1, 2], "dimension 0 of shape [-1, 2] is -1"),
        ([1, 2.0], "does not match"),
        ([1, True], "does not match"),
    ],
)
@pytest.mark.parametrize("wire", ["json", "binary"])
def test_impossible_shapes_are_invalid_argument(shape, words, wire):
    if wire == "binary":
        with pytest.raises(InvalidArgument) as refused:
            _binary("FP32", shape, b"")
    else:
        body = orjson.dumps({"inputs": [{"name": "T", "shape": shape, "datatype": "FP32",
                                         "data": []}]})  # fmt: skip
        with pytest.raises(InvalidArgument) as refused:
            decode(body, specs("FP32", (-1,)))
    assert "input 'T'" in refused.value.message and words in refused.value.message


def test_zero_sized_tensors_with_large_dimensions_still_decode():
    req = _binary("FP32", [1, 0, 2**40], b"", spec_shape=(-1, -1))
    assert req.inputs["T"].shape == (1, 0, 2**40)


# --- JSON elements: what KServe V2 allows, nothing else ---------------------------------

BAD_ELEMENTS = [
    ("FP32", None, "is null", "numbers"),
    ("FP32", "1", "is the string '1'", "numbers"),
    ("FP32", True, "is true", "numbers"),
    ("FP32", {}, "is an object", "numbers"),
    ("FP64", False, "is false", "numbers"),
    ("FP16", "0.5", "is the string '0.5'", "numbers"),
    ("INT32", 1.5, "is 1.5", "integers"),
    ("INT32", 1.0, "is 1.0", "integers"),
    ("INT64", True, "is true", "integers"),
    ("INT64", 2.0**64, "is 1.8446744073709552e+19", "integers"),
    ("UINT8", 256, "is 256, outside UINT8's range [0, 255]", None),
    ("INT8", -129, "is -129, outside INT8's range [-128, 127]", None),
    ("UINT64", -1, "is -1, outside UINT64's range", None),
    ("BOOL", 1, "is 1", "true or false"),
    ("BOOL", "true", "is the string 'true'", "true or false"),
    ("BOOL", None, "is null", "true or false"),
    ("BYTES", 7, "is 7", "strings"),
    ("BYTES", None, "is null", "strings"),
    ("BYTES", False, "is false", "strings"),
]
GOOD = {"BOOL": True, "BYTES": "s", "FP32": 0.5, "FP64": 0.5, "FP16": 0.5}


@pytest.mark.parametrize("datatype,bad,words,takes", BAD_ELEMENTS, ids=repr)
@pytest.mark.parametrize("count", [4, 300, CHUNK + 9], ids=["small", "medium", "chunks"])
def test_json_elements_kserve_does_not_allow_are_refused_with_their_index(
    datatype, bad, words, takes, count
):
    index = count - 2
    data = [GOOD.get(datatype, 3)] * count
    data[index] = bad
    body = orjson.dumps(
        {"inputs": [{"name": "T", "shape": [1, count], "datatype": datatype, "data": data}]}
    )
    with pytest.raises(InvalidArgument) as refused:
        decode(body, specs(datatype, (-1,)))
    message = refused.value.message
    assert message.startswith(f"input 'T': element {index} of 'data' {words}"), message
    if takes:
        assert message.endswith(f"{datatype} data must be JSON {takes}"), message


@pytest.mark.parametrize("count", [6, 300, CHUNK + 9], ids=["small", "medium", "chunks"])
def test_json_index_counts_the_leaves_of_nested_data(count):
    data = [[0.5, 0.5] for _ in range(count // 2)]
    data[-1][1] = None
    body = orjson.dumps(
        {"inputs": [{"name": "T", "shape": [count // 2, 2], "datatype": "FP32", "data": data}]}
    )
    with pytest.raises(InvalidArgument, match=f"element {count // 2 * 2 - 1} of 'data' is null"):
        decode(body, specs("FP32", (2,)), max_batch=count)


@pytest.mark.parametrize("count", [3, 300, CHUNK + 9], ids=["small", "medium", "chunks"])
@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
def test_json_values_that_are_allowed_decode_exactly(datatype, count):
    rng = np.random.default_rng(count)
    if datatype == "BYTES":
        data = [f"s{i}" for i in range(count)]
        want = np.array([s.encode() for s in data], dtype=object)
    elif datatype == "BOOL":
        want = rng.random(count) < 0.5
        data = want.tolist()
    else:
        dtype = NUMERIC[datatype]
        if dtype().dtype.kind == "f":
            want = rng.random(count).astype(dtype)
            want[:2] = [0, 1]  # the values a true/false would become, as numbers
        else:
            info = np.iinfo(dtype)
            want = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
            want[:3] = [0, 1, info.max]
        data = want.tolist()
        if datatype.startswith("FP"):
            data[2] = 1  # an integer is a number too
            want[2] = 1
    body = orjson.dumps(
        {"inputs": [{"name": "T", "shape": [1, count], "datatype": datatype, "data": data}]}
    )
    got = decode(body, specs(datatype, (-1,))).inputs["T"]
    assert got.dtype == np.dtype(NUMERIC.get(datatype, object)) and got.shape == (1, count)
    np.testing.assert_array_equal(got.ravel(), want)


def test_a_request_decoded_off_the_loop_takes_a_reloaded_runtime_only_with_the_same_io():
    from types import SimpleNamespace

    from aserve.codecs.validate import same_io
    from aserve.errors import Unavailable

    def runtime(shape):
        io = specs("FP32", shape)
        return SimpleNamespace(name="m", input_specs=io, output_specs=io, max_batch_size=8)

    before = runtime((2,))
    assert same_io(before, before) is before
    now = runtime((2,))
    assert same_io(before, now) is now
    with pytest.raises(Unavailable, match="model 'm' was reloaded with other inputs"):
        same_io(before, runtime((3,)))
