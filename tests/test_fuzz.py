"""Fuzzing the HTTP frontend: thousands of malformed requests, every one refused with a 4xx.

hypothesis builds the requests and one aiohttp session (keep-alive) sends them,
one at a time, to a real server on loopback that serves a numeric model with
several datatypes, a variable-shape model, a python handler with a BYTES input
and a tiny decoder (KServe V2 ``/infer``, the binary tensor extension, Triton's
``/generate``, the OpenAI routes, SSE or NDJSON; TorchServe's ``/predictions``
with raw and multipart bodies). Each strategy starts from a valid request
and breaks it in one way that is certain to be wrong: bad JSON, wrong types,
huge or negative shapes, shape/data mismatches, unknown datatypes, binary
headers and ``binary_data_size`` values that lie, truncated and mis-encoded
bodies, out-of-range sampling settings, multipart bodies that are cut short,
nested, flooded with parts or headers. Every answer must be a 4xx with a JSON
error body: a 5xx, a dropped connection or a hang (no answer within
``REQUEST_TIMEOUT_S``) fails the test, and hypothesis shrinks the request that
did it. Afterwards the server must still answer correct inferences, and its
log must hold no traceback.

Runs are reproducible (``derandomize=True``, no example database).
Features aserve refuses on purpose with 501 (shared memory, classification,
sequence batching) are not malformed requests and are left out.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import gzip
import json
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import torch
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from reload_helpers import copy_handler

from aserve.types.tensors import numpy_dtype

pytestmark = pytest.mark.timeout(300)

REQUEST_TIMEOUT_S = 20
MAX_BODY = 64 * 1024
MAX_ELEMENTS = 4096
MAX_TOKENS_CAP = 120  # tests/gen_helpers.py GENERATION
MIN_REQUESTS = 3000
IHCL = "Inference-Header-Content-Length"


# --- the server and the wire ------------------------------------------------------


@pytest.fixture(scope="module")
def srv(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    import lm_models
    from gen_helpers import GENERATION

    folder = tmp_path_factory.mktemp("fuzz")
    copy_handler(folder)
    copy_handler(folder, "raw_body")
    gpt2 = lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    mixed_io = [("FLAGS", "BOOL"), ("SMALL", "INT8"), ("BIG", "INT64"), ("HALF", "FP16"),
                ("DOUBLE", "FP64"), ("OCTETS", "UINT8")]  # fmt: skip
    config = {
        "limits": {"max_request_bytes": MAX_BODY, "max_tensor_elements": MAX_ELEMENTS},
        "models": [
            model_entry(
                "affine", str(model_dir / "affine.pt"),
                [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
                batching={"max_batch_size": 32, "max_delay_ms": 0},
            ),
            model_entry(
                "mixed", str(model_dir / "mixed.pt"),
                [spec(f"IN_{n}", t, [3]) for n, t in mixed_io],
                [spec(f"OUT_{n}", t, [3]) for n, t in mixed_io], batching={"max_batch_size": 2},
            ),
            model_entry(
                "spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])],
                [spec("Y", "FP32", [1])], batching={"max_batch_size": 4},
            ),
            {
                "name": "tokenizer", "engine": "python", "handler": "text_tokenizer:ByteTokenizer",
                "inputs": [spec("TEXT", "BYTES", [1])],
                "outputs": [spec("IDS", "FP32", [16]), spec("LENGTH", "INT64", [1]),
                            spec("UPPER", "BYTES", [1]), spec("BATCH", "INT64", [1])],
                "batching": {"max_batch_size": 8},
            },
            {"name": "gpt2", "engine": "decoder", "path": str(gpt2), "generation": GENERATION},
            {
                "name": "raw", "engine": "python", "handler": "raw_body:RawBody",
                "inputs": [spec("TEXT", "BYTES", [1])],
                "outputs": [spec("LENGTH", "INT64", [1]), spec("BATCH", "INT64", [1])],
            },
        ],
    }  # fmt: skip
    server = start_server(write_config(folder, config))
    yield server
    server.stop()


@dataclass
class Req:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False  # send the body with Transfer-Encoding: chunked

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        body = self.body if self.body is None or len(self.body) < 600 else self.body[:600] + b"..."
        return (
            f"Req({self.method} {self.path} headers={self.headers} chunked={self.chunked} {body!r})"
        )


@dataclass
class Answer:
    status: int
    content_type: str
    headers: dict[str, str]
    body: bytes


class Wire:
    """One aiohttp session on a loop in a thread; ``send`` blocks until the answer."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.sent = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._session = self._call(self._open())

    async def _open(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            auto_decompress=False,
        )

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(REQUEST_TIMEOUT_S + 5)

    async def _send(self, req: Req) -> Answer:
        data: Any = req.body
        if req.chunked and req.body is not None:
            body = req.body

            async def chunks() -> Any:
                for i in range(0, len(body), 8192):
                    yield body[i : i + 8192]

            data = chunks()
        headers = {"Content-Type": "application/json", **req.headers}
        async with self._session.request(
            req.method, self.base + req.path, data=data, headers=headers
        ) as r:
            return Answer(r.status, r.content_type, dict(r.headers), await r.read())

    def send(self, req: Req) -> Answer:
        self.sent += 1
        return self._call(self._send(req))

    def close(self) -> None:
        self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture(scope="module")
def wire(srv: ServerProcess) -> Iterator[Wire]:
    w = Wire(srv.base)
    yield w
    w.close()


def refused(wire: Wire, req: Req) -> dict[str, Any]:
    """Send ``req``; it must be answered with a 4xx and a JSON error object."""
    a = wire.send(req)
    assert 400 <= a.status < 500, f"{a.status} for {req!r}: {a.body[:500]!r}"
    assert a.content_type == "application/json", (
        f"{a.status} {a.content_type} for {req!r}: {a.body!r}"
    )
    doc = orjson.loads(a.body)
    assert isinstance(doc, dict) and doc.get("error"), f"no error in {doc!r} for {req!r}"
    return doc


def fuzz(max_examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@dataclass(frozen=True)
class Nested:
    """Lists nested ``depth`` deep around ``leaves``, written by :func:`dumps` as raw
    text: the stdlib's JSON writer recurses and stops near depth 1000."""

    depth: int
    leaves: str

    def text(self) -> str:
        return "[" * self.depth + self.leaves + "]" * self.depth


def dumps(doc: Any) -> bytes:
    """JSON by the stdlib, which writes integers of any size; :class:`Nested` in place."""
    nested: list[Nested] = []

    def mark(v: Any) -> str:
        nested.append(v)
        return f"@nested{len(nested) - 1}@"

    text = json.dumps(doc, default=mark)
    for i, v in enumerate(nested):
        text = text.replace(f'"@nested{i}@"', v.text())
    return text.encode()


# --- values ---------------------------------------------------------------------------

_KINDS: dict[str, st.SearchStrategy[Any]] = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-(2**70), 2**70),
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "str": st.text(max_size=12),
}
_SCALARS = st.one_of(*_KINDS.values())
# Two levels deep at most: a recursive strategy costs hypothesis several times more per example.
_SHALLOW = _SCALARS | st.lists(_SCALARS, max_size=2)
_KINDS["list"] = st.lists(_SHALLOW, max_size=3)
_KINDS["dict"] = st.dictionaries(st.text(max_size=6), _SHALLOW, max_size=3)
JSON_VALUES = st.one_of(*_KINDS.values())


def values(*but: str) -> st.SearchStrategy[Any]:
    """JSON values of every kind but those named (none, bool, int, float, str, list, dict).

    Built from the kinds rather than filtered: hypothesis spends less per example.
    """
    return st.one_of(*(s for kind, s in _KINDS.items() if kind not in but))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _numeric_text(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


# None mostly means "not given": the *_SET strategies leave it out.
NON_LIST = values("list")
NON_DICT = values("dict")
NON_DICT_SET = values("dict", "none")
NON_STR = values("str")
NON_STR_SET = values("str", "none")
NON_BOOL = values("bool")
NON_BOOL_SET = values("bool", "none")
NON_NUMBER = values("none", "int", "float")
NON_INT = values("none", "int")  # a float or a bool is not an integer
ANY_SET = values("none")
TRUTHY = ANY_SET.filter(bool)
NOT_POSITIVE = st.one_of(
    values("none", "int", "float"),
    st.integers(max_value=0),
    st.floats(max_value=0, allow_nan=False, allow_infinity=False),
)
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=16
)
HUGE = st.integers(2**64, 10**30)  # past what orjson reads as an integer


def _not_int_text(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


# --- KServe V2 /infer -----------------------------------------------------------------

AFFINE_X = [i / 8 - 1 for i in range(16)]
MIXED = {
    "IN_FLAGS": ("BOOL", [True, False, True]),
    "IN_SMALL": ("INT8", [-3, 0, 7]),
    "IN_BIG": ("INT64", [2**40, -5, 9]),
    "IN_HALF": ("FP16", [0.5, -1.25, 2.0]),
    "IN_DOUBLE": ("FP64", [1.5, -2.5, 1e100]),
    "IN_OCTETS": ("UINT8", [0, 17, 249]),
}
VALID: dict[str, dict[str, Any]] = {
    "affine": {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": AFFINE_X}]
    },
    "mixed": {
        "inputs": [
            {"name": n, "datatype": t, "shape": [1, 3], "data": d} for n, (t, d) in MIXED.items()
        ]
    },
    "spin": {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
    "tokenizer": {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["hello"]}]
    },
}
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES", "fp32", "FLOAT", "FP8", "INT128", "", "STRING"]  # fmt: skip


def _infer(model: str, doc: Any, **kw: Any) -> Req:
    return Req("POST", f"/v2/models/{model}/infer", dumps(doc), **kw)


@functools.cache
def _bad_shape(model: str, index: int) -> st.SearchStrategy[Any]:
    """Shapes that cannot match the input's data: wrong rank, negative, non-int, huge, other sizes."""
    item = VALID[model]["inputs"][index]
    rank = len(item["shape"])
    count = int(np.prod(item["shape"]))
    bad_dim = st.one_of(
        st.integers(max_value=-1), st.floats(), st.text(max_size=4), st.booleans(), st.none(), HUGE
    )
    return st.one_of(
        NON_LIST,
        st.lists(st.integers(0, 64), max_size=5).filter(lambda s: len(s) != rank),
        st.lists(st.integers(0, 2**62), min_size=rank, max_size=rank).filter(
            lambda s: int(np.prod(s, dtype=object)) != count
        ),
        st.tuples(st.integers(0, rank - 1), bad_dim).map(
            lambda t: [t[1] if i == t[0] else d for i, d in enumerate(item["shape"])]
        ),
        st.sampled_from(
            [
                [1, 10**12],
                [10**9, 16],
                [2**63, 1],
                [1, 2**64 - 1],
                [0, 16],
                [-1, 16],
                # Past what numpy can index, with a zero that makes them empty (or not).
                [0, 2**63 - 1],
                [0, 2**64 - 1],
                [0, 2**62],
                [1, 2**61],
                [2**61, 4],
            ]
        ).filter(lambda s: s != item["shape"]),
    )


@functools.cache
def _bad_data(model: str, index: int) -> st.SearchStrategy[Any]:
    """Data that cannot be the input's: not a list, other counts, wrong element types."""
    item = VALID[model]["inputs"][index]
    count = int(np.prod(item["shape"]))
    wrong_count = st.integers(0, 40).filter(lambda n: n != count)
    strategies = [
        NON_LIST,
        wrong_count.map(lambda n: ["a"] * n if model == "tokenizer" else [1] * n),
    ]
    if model == "tokenizer":  # BYTES data must be strings
        strategies.append(st.lists(NON_STR, min_size=count, max_size=count))
    elif item["datatype"] in ("FP32", "FP64", "FP16"):  # not JSON numbers (null, "1", true too)
        junk = st.one_of(
            st.text(max_size=6),
            st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2),
            st.none(),
            st.booleans(),
        )
        strategies.append(_one_element(count, junk, 0.5))
    elif item["datatype"] in ("INT8", "UINT8", "INT64"):  # out of the type's range, or no integer
        lo, hi = {"INT8": (-128, 127), "UINT8": (0, 255), "INT64": (-(2**63), 2**63 - 1)}[
            item["datatype"]
        ]
        out = st.one_of(st.integers(max_value=lo - 1), st.integers(min_value=hi + 1))
        strategies.append(out.map(lambda v: [v] * count))
        strategies.append(_one_element(count, NON_INT, 1))
    elif item["datatype"] == "BOOL":  # only true and false
        strategies.append(_one_element(count, NON_BOOL, True))
    # Two elements nested deeper than any shape, up to orjson's limit of 1024 with
    # the three levels around 'data': decoding must not recurse without bound.
    leaves = '"a", "b"' if model == "tokenizer" else "1, 1"
    depth = st.one_of(st.integers(1, 1021), st.integers(990, 1021))
    strategies.append(depth.map(lambda d: Nested(d, leaves)))
    return st.one_of(*strategies)


def _one_element(count: int, junk: st.SearchStrategy[Any], good: Any) -> st.SearchStrategy[Any]:
    """Valid data with one element, anywhere, replaced by ``junk``."""
    return st.tuples(st.integers(0, count - 1), junk).map(
        lambda t: [t[1] if i == t[0] else good for i in range(count)]
    )


@st.composite
def v2_malformed(draw: st.DrawFn) -> Req:
    model = draw(st.sampled_from(sorted(VALID)))
    doc = copy.deepcopy(VALID[model])
    items = doc["inputs"]
    i = draw(st.integers(0, len(items) - 1))
    item = items[i]
    kind = draw(st.sampled_from([
        "not an object", "inputs", "input item", "outputs", "parameters", "id",
        "name", "datatype", "shape", "data", "input parameters", "binary size without header",
        "duplicate", "missing", "batch mismatch", "batch too big", "timeout header",
    ]))  # fmt: skip
    headers: dict[str, str] = {}
    if kind == "not an object":
        doc = draw(NON_DICT)
    elif kind == "inputs":
        doc["inputs"] = draw(st.one_of(NON_LIST, st.just([])))
    elif kind == "input item":
        items[i] = draw(NON_DICT)
    elif kind == "outputs":
        doc["outputs"] = draw(st.one_of(
            values("list", "none"),
            st.lists(NON_DICT, min_size=1, max_size=3),
            st.lists(st.fixed_dictionaries({"name": NON_STR}), min_size=1, max_size=2),
            st.text(max_size=8).map(lambda s: [{"name": "no such " + s}]),
            NON_DICT_SET.map(lambda p: [{"name": _first_output(model), "parameters": p}]),
            NON_BOOL_SET.map(lambda b: [{"name": _first_output(model), "parameters": {"binary_data": b}}]),
        ))  # fmt: skip
    elif kind == "parameters":
        doc["parameters"] = draw(st.one_of(
            NON_DICT_SET,
            NON_BOOL_SET.map(lambda v: {"binary_data_output": v}),
            st.sampled_from(["timeout_ms", "timeout"]).flatmap(
                lambda key: NOT_POSITIVE.map(lambda v: {key: v})
            ),
        ))  # fmt: skip
    elif kind == "id":
        doc["id"] = draw(NON_STR_SET)
    elif kind == "name":
        names = [it["name"] for it in VALID[model]["inputs"]]
        item["name"] = draw(
            st.one_of(NON_STR, st.text(max_size=10)).filter(lambda n: n not in names)
        )
    elif kind == "datatype":
        item["datatype"] = draw(
            st.one_of(NON_STR, st.sampled_from(DATATYPES), st.text(max_size=8)).filter(
                lambda t: t != item["datatype"]
            )
        )
    elif kind == "shape":
        item["shape"] = draw(_bad_shape(model, i))
    elif kind == "data":
        item["data"] = draw(_bad_data(model, i))
    elif kind == "input parameters":
        item["parameters"] = draw(NON_DICT_SET)
    elif kind == "binary size without header":
        item["parameters"] = {"binary_data_size": draw(ANY_SET)}
        del item["data"]
    elif kind == "duplicate":
        items.append(copy.deepcopy(item))
    elif kind == "missing":
        if len(items) == 1:
            doc["inputs"] = []
        else:
            del items[i]
    elif kind == "batch mismatch":
        if model == "mixed":
            item["shape"] = [2, 3]
            item["data"] = item["data"] * 2
        else:  # a batch of 0
            item["shape"] = [0, *item["shape"][1:]]
            item["data"] = []
    elif kind == "batch too big":
        limit = {"affine": 32, "mixed": 2, "spin": 4, "tokenizer": 8}[model]
        n = draw(st.integers(limit + 1, limit + 4))
        for it in items:
            it["shape"] = [n, *it["shape"][1:]]
            it["data"] = it["data"] * n
    elif kind == "timeout header":
        headers["aserve-timeout-ms"] = draw(
            HEADER_TEXT.filter(lambda s: not _numeric_text(s) or not float(s) > 0)
        )
    return _infer(model, doc, headers=headers)


def _first_output(model: str) -> str:
    return {"affine": "OUTPUT0", "mixed": "OUT_FLAGS", "spin": "Y", "tokenizer": "IDS"}[model]


# --- the binary tensor extension ------------------------------------------------------


def _bytes_tensor(texts: list[bytes]) -> bytes:
    return b"".join(len(t).to_bytes(4, "little") + t for t in texts)


BINARY: dict[str, tuple[list[dict[str, Any]], list[bytes]]] = {
    "affine": (
        [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16]}],
        [np.asarray(AFFINE_X, np.float32).tobytes()],
    ),
    "spin": ([{"name": "X", "datatype": "FP32", "shape": [1, 4]}], [np.ones(4, np.float32).tobytes()]),
    "tokenizer": (
        [{"name": "TEXT", "datatype": "BYTES", "shape": [2, 1]}],
        [_bytes_tensor([b"hello", b"w\xc3\xb6rld"])],
    ),
    "mixed": (
        [{"name": n, "datatype": t, "shape": [1, 3]} for n, (t, _) in MIXED.items()],
        [np.asarray(d, dtype=numpy_dtype(t)).tobytes() for t, d in MIXED.values()],
    ),
}  # fmt: skip


def _binary_request(model: str, sizes: list[Any], chunks: list[bytes]) -> tuple[bytes, int]:
    specs, _ = BINARY[model]
    inputs = [
        {**s, "parameters": {"binary_data_size": n}} for s, n in zip(specs, sizes, strict=True)
    ]
    header = dumps({"inputs": inputs})
    return header + b"".join(chunks), len(header)


@st.composite
def binary_lies(draw: st.DrawFn) -> Req:
    model = draw(st.sampled_from(sorted(BINARY)))
    _, chunks = BINARY[model]
    chunks = list(chunks)
    sizes: list[Any] = [len(c) for c in chunks]
    kind = draw(st.sampled_from([
        "header too big", "header too small", "header negative", "header not a number",
        "size too big", "size too small", "size negative", "size not an int",
        "truncated", "trailing bytes", "bytes element lies", "huge shape",
    ]))  # fmt: skip
    i = draw(st.integers(0, len(chunks) - 1))
    if kind == "size too big":
        sizes[i] += draw(st.integers(1, 10**6))
    elif kind == "size too small":
        sizes[i] = draw(st.integers(0, len(chunks[i]) - 1))
    elif kind == "size negative":
        sizes[i] = draw(st.integers(max_value=-1))
    elif kind == "size not an int":
        sizes[i] = draw(NON_INT)
    elif kind == "truncated":
        chunks[-1] = chunks[-1][: draw(st.integers(0, len(chunks[-1]) - 1))]
    elif kind == "trailing bytes":
        chunks.append(draw(st.binary(min_size=1, max_size=64)))
    elif kind == "bytes element lies":
        model, i = "tokenizer", 0
        declared = draw(st.sampled_from([0, 1, 4, 6, 1000, 2**32 - 1]))
        chunks = [declared.to_bytes(4, "little") + b"hello" + _bytes_tensor([b"x"])]
        chunks[0] = chunks[0][: draw(st.integers(0, len(chunks[0])))]
        sizes = [len(chunks[0])]
    body, json_len = _binary_request(model, sizes, chunks)
    if kind == "huge shape":
        specs, _ = BINARY[model]
        dims = draw(st.sampled_from([[1, 10**11], [1, 2**62], [10**9, 1], [3, 10**6]]))
        header = dumps({"inputs": [{**specs[0], "shape": dims,
                                    "parameters": {"binary_data_size": len(chunks[0])}}]})  # fmt: skip
        body, json_len = header + chunks[0], len(header)  # mixed: the other inputs missing too
    if kind == "header too big":
        header_value = str(json_len + draw(st.integers(1, len(body) + 100)))
    elif kind == "header too small":
        header_value = str(draw(st.integers(1, json_len - 1)))
    elif kind == "header negative":
        header_value = str(draw(st.integers(max_value=-1)))
    elif kind == "header not a number":
        header_value = draw(HEADER_TEXT.filter(_not_int_text))
    else:
        header_value = str(json_len)
    return Req("POST", f"/v2/models/{model}/infer", body, headers={IHCL: header_value})


# --- bodies that are not JSON, and encodings -------------------------------------------

POST_PATHS = [
    "/v2/models/affine/infer", "/v2/models/tokenizer/infer", "/v2/models/mixed/infer",
    "/v2/models/gpt2/infer", "/v2/models/gpt2/generate", "/v2/models/gpt2/generate_stream",
    "/v1/completions", "/v1/chat/completions",
]  # fmt: skip
VALID_BODIES = {
    "/v2/models/affine/infer": dumps(VALID["affine"]),
    "/v2/models/tokenizer/infer": dumps(VALID["tokenizer"]),
    "/v2/models/mixed/infer": dumps(VALID["mixed"]),
    "/v2/models/gpt2/infer": dumps(
        {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}]}
    ),
    "/v2/models/gpt2/generate": dumps({"text_input": "Hi", "parameters": {"max_tokens": 2}}),
    "/v2/models/gpt2/generate_stream": dumps({"text_input": "Hi", "max_tokens": 2}),
    "/v1/completions": dumps({"model": "gpt2", "prompt": "Hi", "max_tokens": 2}),
    "/v1/chat/completions": dumps(
        {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ),
}
JUNK = [
    b"", b"{", b"[", b"}", b"null", b"true", b"0", b"1e999", b'"x"', b"{}garbage", b"\xff\xfe\x00",
    b'{"inputs": "\\ud800"}', b'{"a": 1,}', b"{'a': 1}", b"[" * 2000, b"{" * 100,
    b'{"x": ' + b"9" * 5000 + b"}", b"\x00" * 100, b"NaN", b'{"inputs": [NaN]}',
]  # fmt: skip


@st.composite
def not_json(draw: st.DrawFn) -> Req:
    path = draw(st.sampled_from(POST_PATHS))
    valid = VALID_BODIES[path]
    body = draw(st.one_of(
        st.binary(max_size=300),
        st.sampled_from(JUNK),
        st.integers(0, len(valid) - 1).map(lambda k: valid[:k]),  # truncated
        st.tuples(st.integers(0, len(valid) - 1), st.binary(min_size=1, max_size=4)).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0] + 1 :]
        ).filter(_not_json),  # a byte swapped for a few that break it
    ))  # fmt: skip
    return Req("POST", path, body, chunked=draw(st.booleans()))


def _not_json(body: bytes) -> bool:
    try:
        json.loads(body)  # more lenient than orjson (NaN, lone surrogates)
    except (ValueError, UnicodeDecodeError):
        return True
    return False


@st.composite
def bad_encoding(draw: st.DrawFn) -> Req:
    path = draw(st.sampled_from(POST_PATHS))
    valid = VALID_BODIES[path]
    encoding = draw(
        st.sampled_from(
            ["gzip", "deflate", "x-bogus", "identity", "GZIP", "gzip, deflate", "br", "zstd"]
        )
    )
    zipped = gzip.compress(valid) if "gzip" in encoding.lower() else zlib.compress(valid)
    body = draw(st.one_of(
        st.binary(max_size=200),
        st.integers(0, max(0, len(zipped) - 12)).map(lambda k: zipped[:k]),  # cut before its end
        st.just(gzip.compress(b'{"inputs": [')),
        st.just(zlib.compress(b"not json at all")),
    ))  # fmt: skip
    return Req("POST", path, body, headers={"Content-Encoding": encoding})


@st.composite
def too_large(draw: st.DrawFn) -> Req:
    """Over max_request_bytes (413), or over max_tensor_elements (413) within it."""
    path = draw(st.sampled_from(POST_PATHS))
    kind = draw(st.sampled_from(["body", "chunked body", "elements"]))
    if kind == "elements":
        n = draw(st.integers(MAX_ELEMENTS + 1, MAX_BODY // 4 - 200))
        header = dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, n],
                                    "parameters": {"binary_data_size": 4 * n}}]})  # fmt: skip
        return Req(
            "POST", "/v2/models/spin/infer", header + bytes(4 * n), headers={IHCL: str(len(header))}
        )
    size = draw(st.integers(MAX_BODY + 1, 4 * MAX_BODY))
    body = b'{"pad": "' + b"x" * size + b'"}'
    return Req("POST", path, body, chunked=kind == "chunked body")


# --- routes, methods, models ------------------------------------------------------------


@st.composite
def bad_route(draw: st.DrawFn) -> Req:
    kind = draw(st.sampled_from(["model", "version", "method", "not generation", "config", "path"]))
    name = draw(st.from_regex(r"[A-Za-z0-9_-]{1,10}", fullmatch=True))
    if kind == "model":
        name = name if name not in ("affine", "mixed", "spin", "tokenizer", "gpt2") else name + "_"
        suffix = draw(st.sampled_from(
            ["/infer", "/generate", "/generate_stream", "", "/ready", "/stats", "/config"]
        ))  # fmt: skip
        method = "GET" if suffix in ("", "/ready", "/stats", "/config") else "POST"
        return Req(method, f"/v2/models/{name}{suffix}", VALID_BODIES["/v2/models/affine/infer"])
    if kind == "version":
        version = str(draw(st.integers(2, 10**6)))
        return Req(
            "POST",
            f"/v2/models/affine/versions/{version}/infer",
            VALID_BODIES["/v2/models/affine/infer"],
        )
    if kind == "method":
        path = draw(st.sampled_from(POST_PATHS))
        return Req(
            draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])), path, VALID_BODIES[path]
        )
    if kind == "config":  # the model config: a version the model lacks, or a method not GET
        model = draw(st.sampled_from(["affine", "mixed", "tokenizer", "gpt2", "raw"]))
        if draw(st.booleans()):
            version = draw(st.one_of(
                st.integers(2, 10**6).map(str), st.from_regex(r"[A-Za-z_-]{1,8}", fullmatch=True)
            ))  # fmt: skip
            return Req("GET", f"/v2/models/{model}/versions/{version}/config", b"")
        method = draw(st.sampled_from(["POST", "PUT", "DELETE", "PATCH"]))
        return Req(method, f"/v2/models/{model}/config", b"{}")
    if kind == "not generation":  # generate on a model that does not generate
        model = draw(st.sampled_from(["affine", "tokenizer"]))
        return Req("POST", f"/v2/models/{model}/generate", VALID_BODIES["/v2/models/gpt2/generate"])
    return Req("POST", "/v2/" + name, b"{}")


# --- Triton's generate extension ---------------------------------------------------------

GEN_BAD: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(NON_INT, st.integers(max_value=0), st.integers(MAX_TOKENS_CAP + 1, 2**63)),
    "temperature": st.one_of(NON_NUMBER, st.floats(max_value=-1e-9, allow_infinity=False)),
    "top_p": st.one_of(NON_NUMBER, st.floats(max_value=0, allow_infinity=False),
                       st.floats(min_value=1.0000001, allow_infinity=False)),
    "top_k": st.one_of(NON_INT, st.integers(max_value=-2)),
    "seed": st.one_of(NON_INT, st.integers(max_value=-1), st.integers(2**64, 2**70)),
    "stop": st.one_of(values("str", "none", "list"),
                      st.lists(NON_STR, min_size=1, max_size=3), st.just(""), st.just(["a", ""]),
                      st.lists(st.just("s"), min_size=17, max_size=20)),
    "ignore_eos": NON_BOOL_SET,
    "exclude_input_in_output": NON_BOOL,
    "timeout_ms": NOT_POSITIVE,
    "timeout": NOT_POSITIVE,
}  # fmt: skip


# Streams are SSE or NDJSON by the Accept header; a refusal comes before either starts.
STREAM_ACCEPT = st.sampled_from([
    {}, {"Accept": "application/x-ndjson"}, {"Accept": "text/event-stream, application/x-ndjson"},
])  # fmt: skip


@st.composite
def generate_malformed(draw: st.DrawFn) -> Req:
    path = "/v2/models/gpt2/" + draw(st.sampled_from(["generate", "generate_stream"]))
    doc: dict[str, Any] = {"text_input": "Hi", "parameters": {"max_tokens": 2}}
    kind = draw(st.sampled_from(["text_input", "id", "parameters", "param", "top-level param"]))
    if kind == "text_input":
        doc["text_input"] = draw(NON_STR)
    elif kind == "id":
        doc["id"] = draw(NON_STR_SET)
    elif kind == "parameters":
        doc["parameters"] = draw(NON_DICT.filter(bool))
    elif kind == "param":
        key = draw(st.sampled_from(sorted(GEN_BAD)))
        doc["parameters"][key] = draw(GEN_BAD[key])
    else:  # Triton reads top-level keys as parameters
        key = draw(st.sampled_from(sorted(GEN_BAD)))
        doc = {"text_input": "Hi", "max_tokens": 2, key: draw(GEN_BAD[key])}
    return Req("POST", path, dumps(doc), headers=draw(STREAM_ACCEPT))


# --- the OpenAI API ---------------------------------------------------------------------

OPENAI_BAD: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(NON_STR, st.just(""), st.just("affine"),
                       st.text(max_size=10).filter(lambda s: s not in ("gpt2", ""))),
    "max_tokens": GEN_BAD["max_tokens"],
    "temperature": st.one_of(NON_NUMBER, st.floats(max_value=-1e-9, allow_infinity=False),
                             st.floats(min_value=2.0000001, allow_infinity=False)),
    "top_p": GEN_BAD["top_p"],
    "top_k": GEN_BAD["top_k"],
    "seed": NON_INT,
    "stop": st.one_of(values("str", "none", "list"),
                      st.lists(NON_STR, min_size=1, max_size=3), st.just(""), st.just(["a", ""]),
                      st.lists(st.just("s"), min_size=5, max_size=8)),
    "n": st.one_of(NON_INT, st.integers(max_value=0), st.integers(min_value=9)),  # max_num_seqs 8
    "stream": NON_BOOL_SET,
    "ignore_eos": NON_BOOL_SET,
    "presence_penalty": st.one_of(NON_NUMBER, st.floats(min_value=2.0001, allow_infinity=False)),
    "frequency_penalty": st.one_of(NON_NUMBER, st.floats(max_value=-2.0001, allow_infinity=False)),
    "logit_bias": st.one_of(NON_DICT_SET, st.just({"x": 1}), st.just({"1": 101}),
                            st.just({"99999999": 1})),
    "repetition_penalty": st.one_of(NON_NUMBER, st.just(0), st.floats(min_value=2.0001,
                                                                      allow_infinity=False)),
    "min_tokens": st.one_of(NON_INT, st.integers(max_value=-1), st.integers(min_value=3)),
}  # fmt: skip
CHAT_BAD: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.one_of(
        NON_LIST, st.just([]),
        st.lists(NON_DICT, min_size=1, max_size=3),
        st.fixed_dictionaries({"role": ANY_SET.filter(
            lambda r: r not in ("system", "developer", "user", "assistant", "tool")
        ), "content": st.just("Hi")}).map(lambda m: [m]),
        st.fixed_dictionaries({"role": st.just("user"), "content": values("str", "list")}).map(lambda m: [m]),
        st.lists(NON_DICT | st.fixed_dictionaries({"type": NON_STR}), min_size=1, max_size=2).map(
            lambda parts: [{"role": "user", "content": parts}]
        ),
        # A tool's result without the id of an earlier call, or calls that are malformed.
        st.one_of(st.none(), st.text(max_size=5)).map(
            lambda i: [{"role": "tool", "content": "x", **({} if i is None else {"tool_call_id": i})}]
        ),
        st.one_of(
            values("list", "none"), st.lists(NON_DICT, min_size=1, max_size=2),
            st.sampled_from(["", "[]", "{", "1", "null", '"x"']).map(lambda a: [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": a}}
            ]),
        ).map(lambda calls: [{"role": "assistant", "content": None, "tool_calls": calls}]),
    ),
    "max_completion_tokens": GEN_BAD["max_tokens"],
    "logprobs": NON_BOOL_SET,
    "top_logprobs": st.one_of(NON_INT, st.integers(max_value=-1), st.integers(min_value=21)),
    "tools": TRUTHY,
    "tool_choice": ANY_SET.filter(lambda v: v != "none"),
    "parallel_tool_calls": NON_BOOL_SET,
    "response_format": ANY_SET.filter(
        lambda v: not (isinstance(v, dict) and v in ({"type": "text"}, {"type": "json_object"}))
    ),
}  # fmt: skip
COMPLETION_BAD: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.just([]),
        st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2),
        st.lists(st.text(max_size=4), min_size=2, max_size=4),  # several prompts
        st.lists(st.one_of(st.integers(max_value=-1), st.integers(10**6, 2**63)), min_size=1, max_size=4),
        st.lists(st.floats(allow_nan=False) | st.booleans() | st.none(), min_size=1, max_size=4),
        st.just("word " * 400),  # longer than max_model_len
    ),
    "echo": TRUTHY,
    "suffix": TRUTHY,
    "logprobs": st.one_of(NON_INT.filter(lambda v: v is not False), st.integers(max_value=-1),
                          st.integers(min_value=21)),
    "best_of": st.one_of(NON_INT, st.integers(max_value=0), st.integers(min_value=9)),
}  # fmt: skip


@st.composite
def openai_malformed(draw: st.DrawFn) -> Req:
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    doc: dict[str, Any] = orjson.loads(VALID_BODIES[path])
    table = {**OPENAI_BAD, **(CHAT_BAD if chat else COMPLETION_BAD)}
    kind = draw(
        st.sampled_from([*sorted(table), "not an object", "stream_options", "timeout header"])
    )
    headers: dict[str, str] = dict(draw(STREAM_ACCEPT))
    if draw(st.booleans()) and kind not in ("stream", "stream_options"):
        doc["stream"] = True
    if kind == "not an object":
        doc = draw(NON_DICT)
    elif kind == "stream_options":
        if draw(st.booleans()):
            doc.pop("stream", None)
            doc["stream_options"] = draw(ANY_SET)
        else:
            doc["stream"] = True
            doc["stream_options"] = draw(st.one_of(
                NON_DICT_SET,
                NON_BOOL_SET.map(lambda v: {"include_usage": v}),
            ))  # fmt: skip
    elif kind == "timeout header":
        headers["aserve-timeout-ms"] = draw(
            HEADER_TEXT.filter(lambda s: not _numeric_text(s) or not float(s) > 0)
        )
    else:
        doc[kind] = draw(table[kind])
        if kind == "max_completion_tokens":
            doc.pop("max_tokens")
    return Req("POST", path, dumps(doc), headers=headers)


# --- /predictions: raw bodies and multipart --------------------------------------------

MAX_PARTS = 128  # aserve/frontends/http/predictions.py
BOUNDARY = "fuzzBoundary7"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def _part(name: str, data: bytes, headers: str = "") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n{headers}\r\n'.encode()
        + data
        + b"\r\n"
    )


VALID_MULTIPART = (
    _part("a", b"one") + _part("b", b"two\r\n--almost") + f"--{BOUNDARY}--\r\n".encode()
)


@st.composite
def predictions_malformed(draw: st.DrawFn) -> Req:
    """Multipart bodies that are broken, too many parts, preambles, nesting, header
    floods, bad boundaries; raw bodies for models that take none; unknown models."""
    kind = draw(st.sampled_from([
        "truncated", "junk", "no boundary", "bad boundary", "too many parts", "preamble",
        "nested", "header flood", "no parts", "not a raw model", "unknown model", "too large",
    ]))  # fmt: skip
    headers = {"Content-Type": MULTIPART}
    body = VALID_MULTIPART
    path = "/predictions/raw"
    if kind == "truncated":  # ends before its closing boundary
        body = body[: draw(st.integers(0, len(body) - 5))]
    elif kind == "junk":
        body = draw(st.binary(max_size=300).filter(lambda b: f"--{BOUNDARY}".encode() not in b))
    elif kind == "no boundary":
        headers["Content-Type"] = draw(st.sampled_from(
            ["multipart/form-data", "multipart/form-data; charset=utf-8", "multipart/form-data;"]
        ))  # fmt: skip
    elif kind == "bad boundary":
        bad = draw(st.one_of(st.text("ab", min_size=71, max_size=90), st.just('""')))
        headers["Content-Type"] = f"multipart/form-data; boundary={bad}"
    elif kind == "too many parts":
        n = draw(st.integers(MAX_PARTS + 1, MAX_PARTS + 300))
        body = _part("p", b"x") * n + f"--{BOUNDARY}--\r\n".encode()
    elif kind == "preamble":
        body = (
            draw(st.sampled_from([b"\n", b"x", b"line\r\n"])) * draw(st.integers(1100, 20000))
            + body
        )
    elif kind == "nested":
        inner = b"--in\r\n\r\nx\r\n--in--\r\n"
        body = (
            f"--{BOUNDARY}\r\nContent-Type: multipart/mixed; boundary=in\r\n\r\n".encode()
            + inner + f"\r\n--{BOUNDARY}--\r\n".encode()
        )  # fmt: skip
    elif kind == "header flood":
        lines = "".join(f"X-H{i}: v\r\n" for i in range(draw(st.integers(17, 2000))))
        body = _part("a", b"x", lines) + f"--{BOUNDARY}--\r\n".encode()
    elif kind == "no parts":
        body = f"--{BOUNDARY}--\r\n".encode()
    elif kind == "not a raw model":
        path = "/predictions/" + draw(st.sampled_from(["affine", "tokenizer", "gpt2", "mixed"]))
        headers = {"Content-Type": draw(st.sampled_from(["image/jpeg", MULTIPART]))}
    elif kind == "unknown model":
        name = draw(st.from_regex(r"[A-Za-z0-9_-]{1,10}", fullmatch=True).filter(
            lambda n: n not in ("affine", "mixed", "spin", "tokenizer", "gpt2", "raw")
        ))  # fmt: skip
        path = f"/predictions/{name}" + draw(st.sampled_from(["", "/1"]))
    else:  # over max_request_bytes: raw or multipart, with or without Content-Length
        headers = {"Content-Type": draw(st.sampled_from(["image/jpeg", MULTIPART]))}
        body = _part("big", b"x" * draw(st.integers(MAX_BODY, 2 * MAX_BODY))) + body
    return Req("POST", path, body, headers=headers, chunked=draw(st.booleans()))


# --- the test ---------------------------------------------------------------------------

STRATEGIES: list[tuple[str, st.SearchStrategy[Req], int]] = [
    ("v2 fields", v2_malformed(), 1100),
    ("binary extension", binary_lies(), 600),
    ("not JSON", not_json(), 350),
    ("content encoding", bad_encoding(), 200),
    ("too large", too_large(), 60),
    ("routes", bad_route(), 120),
    ("generate", generate_malformed(), 450),
    ("openai", openai_malformed(), 750),
    ("predictions", predictions_malformed(), 250),
]


def _ok(wire: Wire, req: Req) -> Answer:
    a = wire.send(req)
    assert a.status == 200, f"{a.status} for {req!r}: {a.body[:500]!r}"
    return a


def _outputs(a: Answer) -> dict[str, Any]:
    return {o["name"]: o["data"] for o in orjson.loads(a.body)["outputs"]}


def _correct_answers(wire: Wire, eager_models: dict[str, Any]) -> str:
    """Valid requests of every kind, their values checked; returns a greedy completion."""
    want = eager_models["affine"](torch.tensor([AFFINE_X])).detach().numpy().ravel()
    got = _outputs(_ok(wire, _infer("affine", VALID["affine"])))["OUTPUT0"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    specs, chunks = BINARY["affine"]
    doc = {"inputs": [{**specs[0], "parameters": {"binary_data_size": len(chunks[0])}}],
           "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}  # fmt: skip
    header = dumps(doc)
    a = _ok(wire, Req("POST", "/v2/models/affine/infer", header + chunks[0],
                      headers={IHCL: str(len(header))}))  # fmt: skip
    n = int(a.headers[IHCL])
    assert orjson.loads(a.body[:n])["outputs"][0]["parameters"]["binary_data_size"] == 64
    np.testing.assert_allclose(np.frombuffer(a.body[n:], "<f4"), want, rtol=1e-5, atol=1e-5)

    out = _outputs(_ok(wire, _infer("mixed", VALID["mixed"])))
    assert out["OUT_FLAGS"] == [False, True, False]
    assert out["OUT_SMALL"] == [-6, 0, 14]
    assert out["OUT_BIG"] == [2**40 + 1, -4, 10]
    assert out["OUT_OCTETS"] == [1, 18, 250]

    out = _outputs(_ok(wire, _infer("tokenizer", VALID["tokenizer"])))
    assert (out["LENGTH"], out["UPPER"]) == ([5], ["HELLO"])
    assert out["IDS"][:6] == [*map(float, b"hello"), 0.0]

    a = _ok(wire, Req("POST", "/predictions/raw", VALID_MULTIPART, {"Content-Type": MULTIPART}))
    assert [p["length"] for p in orjson.loads(a.body)["parts"]] == [3, 13]

    greedy = {"model": "gpt2", "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
    completion = orjson.loads(_ok(wire, Req("POST", "/v1/completions", dumps(greedy))).body)
    [choice] = completion["choices"]
    assert choice["finish_reason"] == "length" and completion["usage"]["completion_tokens"] == 8
    gen = {"text_input": "Hello world", "parameters": {"max_tokens": 8, "temperature": 0}}
    a = _ok(wire, Req("POST", "/v2/models/gpt2/generate", dumps(gen)))
    assert orjson.loads(a.body)["text_output"] == choice["text"]
    return choice["text"]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(
    srv: ServerProcess, wire: Wire, eager_models: dict[str, Any]
) -> None:
    before = _correct_answers(wire, eager_models)
    counts: dict[str, int] = {}
    for name, strategy, examples in STRATEGIES:
        start = wire.sent

        @fuzz(examples)
        @given(strategy)
        def check(req: Req) -> None:
            refused(wire, req)

        check()
        counts[name] = wire.sent - start
    total = sum(counts.values())
    assert total >= MIN_REQUESTS, f"only {total} malformed requests were sent: {counts}"
    assert _correct_answers(wire, eager_models) == before
    log = srv.log_text()
    assert "Traceback" not in log and "Error handling request" not in log, log[-5000:]
    print(f"\n{total} malformed requests, each answered 4xx: {counts}")


# --- strings a python handler returns -------------------------------------------------

# Any text, lone surrogates (what an undecodable byte becomes) and control characters too.
HOSTILE_TEXT = st.one_of(
    st.text(st.characters(categories=["Cs", "Cc", "Lu", "Ll", "Nd", "Po", "Zs", "So"]),
            max_size=40),
    st.sampled_from(["\udcff", "\ud800", "a\r\nX-Injected: 1", "\\", '"', "\n", "x" * 5000]),
)  # fmt: skip
HANDLER_KEYS = ("label", "metric", "help", "label_name", "answer", "text")


@st.composite
def handler_strings(draw: st.DrawFn) -> Req:
    """A request that makes the ``hostile_strings`` handler label its metrics, declare
    one, answer, or fail with what hypothesis drew; or a multipart body whose
    headers hold any bytes."""
    if draw(st.booleans()):
        doc: dict[str, Any] = {}
        for key in draw(st.lists(st.sampled_from(HANDLER_KEYS), unique=True, max_size=4)):
            doc[key] = draw(HOSTILE_TEXT)
        if "answer" in doc:
            doc["answer"] = draw(st.sampled_from(["str", "json", "typed", "raise"]))
        # The stdlib writes lone surrogates as \udXXX escapes; the handler's reader
        # makes them lone surrogates again.
        return Req("POST", "/predictions/strings", json.dumps(doc).encode())
    header = st.binary(max_size=40).map(lambda b: b.translate(None, b'"\r\n'))
    name, filename, ctype = draw(header), draw(header), draw(header)
    body = (
        f"--{BOUNDARY}\r\n".encode() + b'Content-Disposition: form-data; name="' + name
        + b'"; filename="' + filename + b'"\r\nContent-Type: ' + ctype + b"\r\n\r\nx\r\n"
        + f"--{BOUNDARY}--\r\n".encode()
    )  # fmt: skip
    query = draw(st.sampled_from(["", "?answer=text"]))
    return Req("POST", "/predictions/strings" + query, body, {"Content-Type": MULTIPART})


@pytest.fixture(scope="module")
def strings_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("fuzz-strings")
    copy_handler(folder, "hostile_strings")
    model = {
        "name": "strings", "engine": "python", "handler": "hostile_strings:HostileStrings",
        "inputs": [spec("TEXT", "BYTES", [1])], "outputs": [spec("ECHO", "BYTES", [1])],
    }  # fmt: skip
    server = start_server(write_config(folder, {"models": [model]}))
    yield server
    server.stop()


def test_strings_a_handler_returns_never_break_metrics_or_answers(
    strings_srv: ServerProcess,
) -> None:
    """Every answer is the handler's (200), a JSON error naming the model (its own
    failure, 500) or the multipart body (400); /metrics and the dashboard's stats
    answer 200 after each."""
    w = Wire(strings_srv.base)
    try:

        @fuzz(300)
        @given(handler_strings())
        def check(req: Req) -> None:
            a = w.send(req)
            assert "X-Injected" not in a.headers, f"{req!r}: {a.headers}"
            if a.status != 200:
                assert a.status in (400, 500) and a.content_type == "application/json", (
                    f"{a.status} {a.content_type} for {req!r}: {a.body[:500]!r}"
                )
                error = orjson.loads(a.body)["error"]
                # 400: the multipart headers cannot be read (a NUL in one, say).
                assert ("model 'strings/1'" if a.status == 500 else "multipart body") in error
            for path in ("/metrics", "/v2/dashboard/stats"):
                got = w.send(Req("GET", path))
                assert got.status == 200, f"{path} after {req!r}: {got.body[:500]!r}"

        check()
        text = w.send(Req("GET", "/metrics")).body.decode()
        assert "aserve_handler_uploads_total" in text
        list(text_string_to_metric_families(text))  # the exposition parses
    finally:
        w.close()
    log = strings_srv.log_text()
    assert "Traceback" not in log and "Logging error" not in log, log[-5000:]
