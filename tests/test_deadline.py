"""The one deadline rule on every route: no infinite, zero or negative timeout
is accepted, the earliest of header, parameter and gRPC deadline wins, and
``limits.max_timeout_ms`` caps whatever is asked for."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from helpers import v2_body, wait_for_stats, wait_idle
from reload_helpers import copy_handler
from stall_watch import watch_loop

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.codecs.timeouts import parameter_timeout_s
from aserve.errors import InvalidArgument
from aserve.frontends.common import resolve_deadline

pytestmark = pytest.mark.timeout(180)

CAP_MS = 2000
SPIN_BUSY = 2_000_000  # columns: several seconds of the spin model, far past CAP_MS
BAD_HEADERS = ["inf", "Infinity", "-inf", "1e309", "nan", "0", "-1", "soon"]
# As JSON text: what a client can put in a body (non-finite numbers are not JSON).
BAD_JSON_PARAMS = ["0", "-1", "-0.5", '"inf"', "true", "1e309", "Infinity", "NaN"]


# --- the rule itself ----------------------------------------------------------


def test_the_earliest_given_wins_else_the_default_and_the_cap_bounds_both() -> None:
    assert resolve_deadline(None, None, None, 5.0, 600.0) == 5.0
    assert resolve_deadline("3000", None, 2.0, 5.0, 600.0) == 2.0
    assert resolve_deadline(None, 60.0, 0.1, 5.0, 600.0) == 0.1
    assert resolve_deadline("100", 60.0, None, 5.0, 600.0) == 0.1
    assert resolve_deadline("60000", 0.1, None, 5.0, 600.0) == 0.1
    assert resolve_deadline(None, 1e305, None, 5.0, 600.0) == 600.0
    assert resolve_deadline(None, None, None, 900.0, 600.0) == 600.0  # a model's default too
    assert parameter_timeout_s({"timeout_ms": 500, "timeout": 100_000}) == 0.1
    assert parameter_timeout_s({"timeout_ms": 2**80}) > 1e20  # finite: the cap bounds it


@pytest.mark.parametrize("value", [*BAD_HEADERS, "\udcff"])
def test_a_header_that_is_no_finite_positive_number_is_refused(value: str) -> None:
    with pytest.raises(InvalidArgument, match="aserve-timeout-ms"):
        resolve_deadline(value, None, None, 5.0, 600.0)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -float("inf"), 0, -1, True, "1"])
@pytest.mark.parametrize("name", ["timeout_ms", "timeout"])
def test_a_parameter_that_is_no_finite_positive_number_is_refused(name: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=f"'{name}'"):
        parameter_timeout_s({name: value})


# --- a real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(
    model_dir: Path, decoder_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("deadline")
    copy_handler(folder)
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    tokenizer = {
        "name": "tokenizer",
        "engine": "python",
        "handler": "text_tokenizer:ByteTokenizer",
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [spec("IDS", "FP32", [16]), spec("LENGTH", "INT64", [1]),
                    spec("UPPER", "BYTES", [1]), spec("BATCH", "INT64", [1])],
    }  # fmt: skip
    pipeline = {
        "name": "text_affine",
        "engine": "pipeline",
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [spec("OUTPUT0", "FP32", [16]), spec("LENGTH", "INT64", [1])],
        "steps": [
            {"model": "tokenizer", "outputs": {"IDS": "INPUT0", "LENGTH": "LENGTH"}},
            {"model": "affine"},
        ],
    }
    config = {
        "grpc": {"port": 0},
        "limits": {"max_timeout_ms": CAP_MS},
        "models": [
            model_entry(
                "spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])],
                [spec("Y", "FP32", [1])], batching={"max_batch_size": 4, "max_delay_ms": 0},
            ),
            model_entry(
                "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                [spec("OUTPUT0", "FP32", [16])],
            ),
            tokenizer, pipeline, gpt2,
        ],
    }  # fmt: skip
    server = start_server(write_config(folder, config), extra_args=("--watch-interval", "0"))
    yield server
    server.stop()


def _http_routes() -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, where the body's parameters go) for every HTTP inference route."""
    text = {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}
    return [
        ("/v2/models/spin/infer", v2_body("X", [1.0], [1, 1]), "parameters"),
        ("/v2/models/tokenizer/infer", {"inputs": [text]}, "parameters"),
        ("/v2/models/text_affine/infer", {"inputs": [text]}, "parameters"),
        ("/v2/models/gpt2/generate", {"text_input": "hi", "max_tokens": 2}, "parameters"),
        ("/v2/models/gpt2/generate_stream", {"text_input": "hi", "max_tokens": 2}, "parameters"),
        ("/v1/completions", {"model": "gpt2", "prompt": "hi", "max_tokens": 2}, ""),
        (
            "/v1/chat/completions",
            {"model": "gpt2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "",
        ),
    ]


async def _post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=body, headers=headers) as r:
        raw = await r.read()
        return r.status, orjson.loads(raw) if r.content_type == "application/json" else raw


def _error_text(doc: Any) -> str:
    error = doc["error"]
    return error["message"] if isinstance(error, dict) else error  # OpenAI's or V2's


async def test_every_http_route_refuses_a_bad_timeout_header_naming_it(srv: ServerProcess) -> None:
    async with aiohttp.ClientSession() as session, watch_loop(srv.base):
        for path, body, _ in _http_routes():
            status, doc = await _post(session, srv.base + path, orjson.dumps(body))
            assert status == 200, (path, doc)  # the route serves without one
            for value in BAD_HEADERS:
                status, doc = await _post(
                    session, srv.base + path, orjson.dumps(body), {"aserve-timeout-ms": value}
                )
                assert status == 400, (path, value, doc)
                assert "aserve-timeout-ms" in _error_text(doc), (path, value, doc)


async def test_every_route_with_parameters_refuses_a_bad_timeout_parameter(
    srv: ServerProcess,
) -> None:
    async with aiohttp.ClientSession() as session, watch_loop(srv.base):
        for path, body, where in _http_routes():
            if not where:
                continue  # OpenAI: a top-level timeout_ms field (test_deadline_routes.py)
            for name in ("timeout_ms", "timeout"):
                for value in BAD_JSON_PARAMS:
                    text = orjson.dumps({**body, where: {"__": 0}}).decode()
                    text = text.replace('"__":0', f'"{name}":{value}')
                    status, doc = await _post(session, srv.base + path, text.encode())
                    assert status == 400, (path, name, value, doc)
                    # A JSON number past a double's range is refused as JSON.
                    words = "JSON" if value in ("1e309", "Infinity", "NaN") else f"'{name}'"
                    assert words in doc["error"], (path, name, value, doc)


def _grpc_request(**params: pb.InferParameter) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="spin", id="r")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(1.0)
    for key, value in params.items():
        request.parameters[key].CopyFrom(value)
    return request


BAD_GRPC_PARAMS = [
    pb.InferParameter(double_param=float("inf")),
    pb.InferParameter(double_param=float("nan")),
    pb.InferParameter(double_param=-1.0),
    pb.InferParameter(int64_param=0),
    pb.InferParameter(int64_param=-1),
    pb.InferParameter(string_param="inf"),
    pb.InferParameter(bool_param=True),
]


async def test_grpc_refuses_a_bad_timeout_parameter_unary_and_streaming(
    srv: ServerProcess,
) -> None:
    async with grpc.aio.insecure_channel(srv.grpc_url) as channel, watch_loop(srv.base):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(_grpc_request(), timeout=30)
        for name in ("timeout_ms", "timeout"):
            for value in BAD_GRPC_PARAMS:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.ModelInfer(_grpc_request(**{name: value}), timeout=30)
                assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT, value
                assert f"'{name}'" in (exc.value.details() or ""), value
            requests = [_grpc_request(**{name: value}) for value in BAD_GRPC_PARAMS]
            async for answer in stub.ModelStreamInfer(iter(requests), timeout=30):
                assert f"'{name}'" in answer.error_message, answer


async def _hold_spin(session: aiohttp.ClientSession, base: str) -> asyncio.Task[Any]:
    """Occupy spin's only instance for longer than the cap; returns the request's task."""
    await wait_idle(session, base, "spin")
    body = orjson.dumps(v2_body("X", [0.5] * SPIN_BUSY, [1, SPIN_BUSY]))
    task = asyncio.create_task(_post(session, base + "/v2/models/spin/infer", body))
    await wait_for_stats(session, base, "spin", lambda s: s["running_batch_count"] == 1)
    return task


def _waited_ms(message: str) -> float:
    m = re.search(r"timed out after ([\d.]+) ms", message)
    assert m, message
    return float(m.group(1))


async def test_a_huge_timeout_is_capped_and_the_earliest_wins(srv: ServerProcess) -> None:
    url = srv.base + "/v2/models/spin/infer"
    small = v2_body("X", [1.0], [1, 1])
    async with aiohttp.ClientSession() as session:
        held = await _hold_spin(session, srv.base)
        # Before the fix, 1e308 ms (or a header of 1e300) meant "wait for ever":
        # these waited for the busy instance and got 200 seconds later.
        capped = [
            _post(session, url, orjson.dumps({**small, "parameters": {"timeout_ms": 1e308}})),
            _post(session, url, orjson.dumps(small), {"aserve-timeout-ms": "1e300"}),
        ]
        # The earliest of header and parameter, whichever carries it.
        early = [
            _post(
                session, url, orjson.dumps({**small, "parameters": {"timeout_ms": 100}}),
                {"aserve-timeout-ms": "60000"},
            ),
            _post(
                session, url, orjson.dumps({**small, "parameters": {"timeout_ms": 60000}}),
                {"aserve-timeout-ms": "100"},
            ),
        ]  # fmt: skip
        async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            huge = pb.InferParameter(int64_param=2**62)
            grpc_call = stub.ModelInfer(_grpc_request(timeout_ms=huge), timeout=3600)
            results = await asyncio.gather(*capped, *early, grpc_call, return_exceptions=True)
        *http_results, grpc_result = results
        for status, doc in http_results[:2]:
            assert status == 504, doc
            assert _waited_ms(doc["error"]) >= CAP_MS * 0.9, doc
        for status, doc in http_results[2:]:
            # The 100 ms deadline applied: the request timed out well before the cap,
            # or admission refused it at once for its 100 ms (a busy machine's loop lag
            # counts against a deadline that short); with 60 s it would wait for the cap.
            if status == 503:
                left = re.search(
                    r"cannot meet the request's deadline: ([\d.]+) ms left", doc["error"]
                )
                assert left and float(left.group(1)) <= 100.0, doc
            else:
                assert status == 504, doc
                assert _waited_ms(doc["error"]) < CAP_MS * 0.75, doc  # 100 ms asked
        assert isinstance(grpc_result, grpc.aio.AioRpcError), grpc_result
        assert grpc_result.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert _waited_ms(grpc_result.details() or "") >= CAP_MS * 0.9
        status, doc = await held  # its own (default) deadline is capped too
        assert status == 504, doc
