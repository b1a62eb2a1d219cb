"""Hostile tensors on a real server: cheap to send, and they must stay cheap to refuse or serve.

- Millions of zero-length BYTES elements (binary extension, gzip-compressed,
  gRPC raw, JSON ``""``): the loop must not stall while they are decoded, and
  with ``limits.max_tensor_elements`` set the refusal comes from the declared
  shape, before any decoding.
- Shapes no tensor can have (dimensions past int64, negative, products past
  what numpy can index): 400 / ``INVALID_ARGUMENT`` naming the input and the
  shape, on HTTP JSON, binary and gRPC.
- JSON elements KServe V2 does not allow (``null``, ``"1"`` or ``true`` for a
  number, ``1.5`` for an integer, ``1`` for BOOL, a number for BYTES): 400
  naming the element's index.

Every hostile case runs inside the loop-stall watchdog (tests/stall_watch.py).
"""

from __future__ import annotations

import asyncio
import gzip
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from reload_helpers import copy_handler
from stall_watch import watch_loop

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

IHCL = "Inference-Header-Content-Length"
# 16 million zero-length elements: 64 MB of length prefixes, under the default
# max_request_bytes (64 MiB) with room for the JSON header.
MANY = 16_000_000
JSON_MANY = 10_000_000
LIMIT = 1_000_000
BIG_MESSAGE = 80 * 1024 * 1024


def _config(model_dir: Path, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "limits": limits,
        "grpc": {"port": 0},
        "models": [
            model_entry(
                "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                [spec("OUTPUT0", "FP32", [16])],
            ),
            model_entry(
                "spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])],
                [spec("Y", "FP32", [1])], batching={"max_batch_size": 4, "max_delay_ms": 0},
            ),
            model_entry(
                "mixed", str(model_dir / "mixed.pt"),
                [spec(f"IN_{n}", t, [3]) for n, t in MIXED_IO],
                [spec(f"OUT_{n}", t, [3]) for n, t in MIXED_IO],
            ),
            {
                "name": "count", "engine": "python", "handler": "count_elements:CountElements",
                "inputs": [spec("ITEMS", "BYTES", [-1])],
                "outputs": [spec("COUNT", "INT64", [1]), spec("TOTAL", "INT64", [1])],
                "batching": {"max_batch_size": 1},
            },
        ],
    }  # fmt: skip


MIXED_IO = [("FLAGS", "BOOL"), ("SMALL", "INT8"), ("BIG", "INT64"), ("HALF", "FP16"),
            ("DOUBLE", "FP64"), ("OCTETS", "UINT8")]  # fmt: skip


def _start(model_dir: Path, folder: Path, limits: dict[str, Any]) -> ServerProcess:
    copy_handler(folder, "count_elements")
    return start_server(write_config(folder, _config(model_dir, limits)))


@pytest.fixture(scope="module")
def srv(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """No max_tensor_elements: what the wire allows is decoded (off the loop)."""
    server = _start(model_dir, tmp_path_factory.mktemp("hostile"), {})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def limited(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _start(
        model_dir, tmp_path_factory.mktemp("hostile-limited"), {"max_tensor_elements": LIMIT}
    )
    yield server
    server.stop()


# --- the wire -----------------------------------------------------------------------


def binary_body(name: str, datatype: str, shape: list[Any], raw: bytes) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                       "parameters": {"binary_data_size": len(raw)}}]})  # fmt: skip
    return header + raw, str(len(header))


def json_body(name: str, datatype: str, shape: list[Any], data: list[Any]) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}
    )


async def post(
    base: str, model: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(
            f"{base}/v2/models/{model}/infer", data=body, headers=headers or {}
        ) as r:
            return r.status, orjson.loads(await r.read())


def _grpc_infer_sync(server: ServerProcess, request: pb.ModelInferRequest) -> Any:
    options = [
        ("grpc.max_send_message_length", BIG_MESSAGE),
        ("grpc.max_receive_message_length", BIG_MESSAGE),
    ]
    with grpc.insecure_channel(server.grpc_url, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            return stub.ModelInfer(request, timeout=120)
        except grpc.RpcError as exc:
            return exc


async def grpc_infer(server: ServerProcess, request: pb.ModelInferRequest) -> Any:
    """The response, or the RpcError the call ended with.

    On a thread of its own: serializing a 64 MB message must not hold the
    test's loop, whose watchdog probes would count it as the server's stall.
    """
    return await asyncio.to_thread(_grpc_infer_sync, server, request)


def zero_length_elements(n: int) -> bytes:
    return bytes(4 * n)  # each element: a 4-byte length of 0


def raw_request(model: str, name: str, datatype: str, shape: list[int], raw: bytes) -> Any:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    return request


# --- finding: cheap tensors that cost seconds ---------------------------------------


async def test_millions_of_empty_bytes_elements_in_binary_do_not_stall_the_loop(srv) -> None:
    body, ihcl = binary_body("ITEMS", "BYTES", [1, MANY], zero_length_elements(MANY))
    async with watch_loop(srv.base) as watch:
        status, doc = await post(srv.base, "count", body, {IHCL: ihcl})
    assert status == 200, doc
    assert doc["outputs"][0]["data"] == [MANY]
    assert watch.probes_s


async def test_a_gzipped_bytes_bomb_does_not_stall_the_loop(srv) -> None:
    body, ihcl = binary_body("ITEMS", "BYTES", [1, MANY], zero_length_elements(MANY))
    packed = gzip.compress(body)
    assert len(packed) < 100_000  # 64 MB that travel as well under 100 KB
    async with watch_loop(srv.base):
        status, doc = await post(
            srv.base, "count", packed, {IHCL: ihcl, "Content-Encoding": "gzip"}
        )
    assert status == 200, doc
    assert doc["outputs"][0]["data"] == [MANY]


async def test_millions_of_empty_bytes_elements_over_grpc_raw_do_not_stall_the_loop(srv) -> None:
    request = raw_request("count", "ITEMS", "BYTES", [1, MANY], zero_length_elements(MANY))
    async with watch_loop(srv.base):
        response = await grpc_infer(srv, request)
    assert not isinstance(response, grpc.RpcError), response
    count = np.frombuffer(response.raw_output_contents[0], np.int64)
    assert count.tolist() == [MANY]


async def test_ten_million_empty_json_strings_do_not_stall_the_loop(srv) -> None:
    body = json_body("ITEMS", "BYTES", [1, JSON_MANY], [""] * JSON_MANY)
    async with watch_loop(srv.base):
        status, doc = await post(srv.base, "count", body)
    assert status == 200, doc
    assert doc["outputs"][0]["data"] == [JSON_MANY]


async def test_varied_bytes_elements_are_decoded_exactly(srv) -> None:
    # Elements of different lengths take the scan, not the uniform fast path.
    items = [b"x" * (i % 5) for i in range(100_000)]
    raw = b"".join(struct.pack("<I", len(x)) + x for x in items)
    body, ihcl = binary_body("ITEMS", "BYTES", [1, len(items)], raw)
    async with watch_loop(srv.base):
        status, doc = await post(srv.base, "count", body, {IHCL: ihcl})
    assert status == 200, doc
    assert doc["outputs"][0]["data"] == [len(items)]


def _limit_message(elements: int) -> str:
    return (
        f"input 'ITEMS' has {elements} elements (shape [1, {elements}]), over the limit "
        f"limits.max_tensor_elements {LIMIT}"
    )


async def test_the_element_limit_refuses_from_the_declared_shape_before_decoding(limited) -> None:
    body, ihcl = binary_body("ITEMS", "BYTES", [1, MANY], zero_length_elements(MANY))
    packed = gzip.compress(body)
    async with watch_loop(limited.base):
        # Three at once, as an attacker would: none of them may cost a decode.
        for status, doc in [
            await post(limited.base, "count", body, {IHCL: ihcl}),
            await post(limited.base, "count", packed, {IHCL: ihcl, "Content-Encoding": "gzip"}),
            await post(limited.base, "count", json_body("ITEMS", "BYTES", [1, MANY], [])),
        ]:
            assert status == 413
            assert doc["error"] == _limit_message(MANY)
        response = await grpc_infer(
            limited, raw_request("count", "ITEMS", "BYTES", [1, MANY], zero_length_elements(MANY))
        )
    assert isinstance(response, grpc.RpcError)
    assert response.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert response.details() == _limit_message(MANY)


async def test_a_shape_that_lies_about_its_bytes_is_refused_before_allocating(srv) -> None:
    # 2 billion elements declared, 64 bytes sent: the count check needs no decoding.
    body, ihcl = binary_body("ITEMS", "BYTES", [1, 2_000_000_000], bytes(64))
    async with watch_loop(srv.base):
        status, doc = await post(srv.base, "count", body, {IHCL: ihcl})
    assert status == 400
    assert "too short for 2000000000 elements" in doc["error"]


# --- finding: shapes no tensor can have ----------------------------------------------

IMPOSSIBLE_SHAPES = [
    ([0, 2**63 - 1], "is too large for a tensor"),
    ([0, 2**64 - 1], "is too large for a tensor"),
    ([0, 2**62], "is too large for a tensor"),  # 2**64 bytes of FP32, zero of them sent
    ([1, 2**61], "is too large for a tensor"),
    ([1, -1], "must not be negative"),
    ([-1, 4], "must not be negative"),
    ([2**62, 4], "is too large for a tensor"),
]


@pytest.mark.parametrize("shape,words", IMPOSSIBLE_SHAPES, ids=str)
@pytest.mark.parametrize("wire", ["json", "binary"])
async def test_impossible_shapes_are_400_over_http(srv, shape, words, wire) -> None:
    if wire == "json":
        body, headers = json_body("X", "FP32", shape, []), {}
    else:
        body, ihcl = binary_body("X", "FP32", shape, b"")
        headers = {IHCL: ihcl}
    async with watch_loop(srv.base):
        status, doc = await post(srv.base, "spin", body, headers)
    assert status == 400, doc
    assert "input 'X'" in doc["error"] and str(shape) in doc["error"]
    if words:
        assert words in doc["error"]


@pytest.mark.parametrize(
    "shape,words",
    [(s, w) for s, w in IMPOSSIBLE_SHAPES if all(-(2**63) <= d < 2**63 for d in s)],
    ids=str,
)
async def test_impossible_shapes_are_invalid_argument_over_grpc(srv, shape, words) -> None:
    async with watch_loop(srv.base):
        response = await grpc_infer(srv, raw_request("spin", "X", "FP32", shape, b""))
    assert isinstance(response, grpc.RpcError)
    assert response.code() == grpc.StatusCode.INVALID_ARGUMENT, response.details()
    assert "input 'X'" in response.details() and str(shape) in response.details()
    if words:
        assert words in response.details()


async def test_the_server_still_serves_after_the_hostile_shapes(srv) -> None:
    status, doc = await post(srv.base, "spin", json_body("X", "FP32", [1, 3], [1.0, 2.0, 3.0]))
    assert status == 200, doc


# --- finding: numeric JSON is lenient --------------------------------------------------

# (model, input, datatype, shape, data, index of the bad element, what the message says)
WRONG_ELEMENTS = [
    ("affine", "INPUT0", "FP32", [1, 16], [0.5] * 3 + [None] + [0.5] * 12, 3, "is null"),
    ("affine", "INPUT0", "FP32", [1, 16], ["1"] + [0.5] * 15, 0, "is the string '1'"),
    ("affine", "INPUT0", "FP32", [1, 16], [0.5] * 15 + [True], 15, "is true"),
    ("affine", "INPUT0", "FP32", [1, 16], [[0.5] * 8, [0.5] * 7 + [False]], 15, "is false"),
    ("affine", "INPUT0", "FP32", [1, 16], [0.5] * 15 + [{}], 15, "is an object"),
    ("mixed", "IN_SMALL", "INT8", [1, 3], [1, 1.5, 2], 1, "is 1.5"),
    ("mixed", "IN_SMALL", "INT8", [1, 3], [1, 2, 300], 2, "is 300, outside INT8's range"),
    ("mixed", "IN_BIG", "INT64", [1, 3], [1, True, 2], 1, "is true"),
    ("mixed", "IN_FLAGS", "BOOL", [1, 3], [True, 1, False], 1, "is 1"),
    ("mixed", "IN_FLAGS", "BOOL", [1, 3], [True, False, "false"], 2, "is the string 'false'"),
    ("mixed", "IN_DOUBLE", "FP64", [1, 3], [1.0, 2.0, None], 2, "is null"),
    ("mixed", "IN_OCTETS", "UINT8", [1, 3], [1, -1, 2], 1, "is -1, outside UINT8's range"),
    ("count", "ITEMS", "BYTES", [1, 3], ["a", 1, "b"], 1, "is 1"),
    ("count", "ITEMS", "BYTES", [1, 3], ["a", "b", None], 2, "is null"),
]


@pytest.mark.parametrize(
    "model,name,datatype,shape,data,index,words", WRONG_ELEMENTS, ids=lambda v: repr(v)[:20]
)
async def test_json_elements_kserve_does_not_allow_are_400_naming_the_index(
    srv, model, name, datatype, shape, data, index, words
) -> None:
    doc_in = {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}
    if model == "mixed":  # every other input valid
        for n, t in MIXED_IO:
            if f"IN_{n}" != name:
                value = [True, False, True] if t == "BOOL" else [1, 2, 3]
                doc_in["inputs"].append(
                    {"name": f"IN_{n}", "datatype": t, "shape": [1, 3], "data": value}
                )
    async with watch_loop(srv.base):
        status, doc = await post(srv.base, model, orjson.dumps(doc_in))
    assert status == 400, doc
    assert f"input '{name}': element {index} of 'data' {words}" in doc["error"]


async def test_json_numbers_of_every_kind_allowed_still_work(srv) -> None:
    doc_in = {"inputs": [
        {"name": "IN_FLAGS", "datatype": "BOOL", "shape": [1, 3], "data": [True, False, True]},
        {"name": "IN_SMALL", "datatype": "INT8", "shape": [1, 3], "data": [-128, 0, 127]},
        {"name": "IN_BIG", "datatype": "INT64", "shape": [1, 3], "data": [-(2**63), 1, 2**63 - 1]},
        {"name": "IN_HALF", "datatype": "FP16", "shape": [1, 3], "data": [0.5, 1, -2]},
        {"name": "IN_DOUBLE", "datatype": "FP64", "shape": [1, 3], "data": [[0.25], [1], [0]]},
        {"name": "IN_OCTETS", "datatype": "UINT8", "shape": [1, 3], "data": [0, 1, 255]},
    ]}  # fmt: skip
    status, doc = await post(srv.base, "mixed", orjson.dumps(doc_in))
    assert status == 200, doc
