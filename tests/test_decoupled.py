"""Decoupled models (a python handler that yields any number of responses per
request), on a real server with tritonclient (gRPC sync and aio) and aiohttp:
ModelStreamInfer with and without the empty final response, several requests
interleaved on one stream, HTTP generate_stream and generate, errors before and
during a stream, the client going (the generator is closed), a full stream
queue, and the infer routes refusing such a model."""

from __future__ import annotations

import asyncio
import queue
import re
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from conftest import ServerProcess, spec, start_server, write_config
from reload_helpers import copy_handler
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(120)

FINAL = "triton_final_response"


def _repeat(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "python",
        "handler": "repeat:Repeat",
        "decoupled": True,
        "inputs": [spec("IN", "INT32", [-1])],
        "outputs": [spec("OUT", "INT32", [1]), spec("IDX", "UINT32", [1])],
        **extra,
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("decoupled")
    copy_handler(folder, "repeat")
    config = {
        "grpc": {"port": 0},
        "models": [
            _repeat("repeat", instances=4),
            # One stream at a time, one waiting: a full queue is reached exactly.
            _repeat("repeat_one", batching={"max_queue_size": 1}),
        ],
    }
    server = start_server(write_config(folder, config))
    yield server
    server.stop()


def _in(values: list[int], cls: Any = grpcclient) -> Any:
    tensor = cls.InferInput("IN", [1, len(values)], "INT32")
    tensor.set_data_from_numpy(np.array([values], np.int32))
    return tensor


def _metric(server: ServerProcess, name: str, model: str = "repeat") -> float:
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    want = re.compile(rf'^{name}_total\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    found = want.search(text)
    return float(found.group(1)) if found else 0.0


def _wait_metric(server: ServerProcess, name: str, want: float, model: str = "repeat") -> None:
    deadline = time.monotonic() + 30
    while _metric(server, name, model) != want:
        assert time.monotonic() < deadline, f"{name} never reached {want}"
        time.sleep(0.05)


# --- gRPC, tritonclient sync -------------------------------------------------------


class _Stream:
    """A tritonclient sync stream whose callback puts each (result, error) in a queue."""

    def __init__(self, server: ServerProcess) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=partial(self._callback, self.results))

    @staticmethod
    def _callback(results: queue.Queue, result: Any, error: Any) -> None:
        results.put((result, error))

    def take(self, n: int) -> list[tuple[Any, Any]]:
        return [self.results.get(timeout=30) for _ in range(n)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def test_stream_infer_sends_a_response_per_element_then_the_empty_final_one(srv) -> None:
    stream = _Stream(srv)
    try:
        stream.client.async_stream_infer(
            "repeat", [_in([4, 2, 0, 1])], request_id="r1", enable_empty_final_response=True
        )
        got = stream.take(5)
    finally:
        stream.close()
    assert [e for _, e in got] == [None] * 5
    data, last = [r for r, _ in got[:4]], got[4][0]
    assert [int(r.as_numpy("OUT")[0, 0]) for r in data] == [4, 2, 0, 1]
    assert [int(r.as_numpy("IDX")[0, 0]) for r in data] == [0, 1, 2, 3]
    assert all(r.as_numpy("OUT").dtype == np.int32 for r in data)
    assert [r.get_response().parameters[FINAL].bool_param for r in data] == [False] * 4
    response = last.get_response()
    assert response.id == "r1" and response.model_name == "repeat"
    assert response.parameters[FINAL].bool_param is True
    assert last.as_numpy("OUT") is None  # no outputs: only the end


def test_without_the_empty_final_response_only_the_data_responses_come(srv) -> None:
    stream = _Stream(srv)
    try:
        stream.client.async_stream_infer("repeat", [_in([7, 8])], request_id="a")
        # A second request on the same stream: its one response follows the first's two,
        # so nothing else came between (no empty final response for "a").
        got = stream.take(2)
        stream.client.async_stream_infer(
            "repeat", [_in([9])], request_id="b", enable_empty_final_response=True
        )
        got += stream.take(2)
    finally:
        stream.close()
    ids = [r.get_response().id for r, _ in got]
    assert ids == ["a", "a", "b", "b"]
    assert [int(r.as_numpy("OUT")[0, 0]) for r, _ in got[:3]] == [7, 8, 9]
    assert got[3][0].get_response().parameters[FINAL].bool_param is True


def test_no_responses_at_all_is_only_the_final_one(srv) -> None:
    stream = _Stream(srv)
    try:
        stream.client.async_stream_infer(
            "repeat", [_in([])], request_id="none", enable_empty_final_response=True
        )
        [(result, error)] = stream.take(1)
    finally:
        stream.close()
    assert error is None
    assert result.get_response().parameters[FINAL].bool_param is True
    assert result.as_numpy("OUT") is None


def test_a_failing_stream_sends_its_error_and_the_stream_goes_on(srv) -> None:
    stream = _Stream(srv)
    try:
        stream.client.async_stream_infer(
            "repeat", [_in([1, 2, 3])], request_id="f", parameters={"fail_at": 2}
        )
        got = stream.take(3)
        stream.client.async_stream_infer(
            "repeat", [_in([5])], request_id="bad", parameters={"bad_yield": True}
        )
        got += stream.take(1)
        stream.client.async_stream_infer("nosuch", [_in([5])], request_id="unknown")
        got += stream.take(1)
        stream.client.async_stream_infer("repeat", [_in([6])], request_id="after")
        got += stream.take(1)
    finally:
        stream.close()
    assert [int(r.as_numpy("OUT")[0, 0]) for r, _ in got[:2]] == [1, 2]
    failed, bad, unknown = got[2][1], got[3][1], got[4][1]
    assert failed.message() == (
        "model 'repeat/1' stream failed: ValueError: asked to fail after 2 responses"
    )
    assert bad.message() == (
        "model 'repeat/1' stream failed: TypeError: stream yielded output(s) 'NOPE' that the "
        "model does not declare (its outputs: OUT, IDX)"
    )
    assert unknown.message().startswith("Request for unknown model: 'nosuch'")
    assert got[5][1] is None and int(got[5][0].as_numpy("OUT")[0, 0]) == 6


def test_a_bad_request_is_refused_before_the_stream_starts(srv) -> None:
    stream = _Stream(srv)
    wrong = grpcclient.InferInput("IN", [1, 2], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 2), np.float32))
    try:
        stream.client.async_stream_infer("repeat", [wrong], request_id="w")
        [(_, error)] = stream.take(1)
    finally:
        stream.close()
    assert "datatype 'FP32' does not match the model's INT32" in error.message()


# --- gRPC, tritonclient aio: requests interleaved on one stream ----------------------


def test_aio_stream_interleaves_requests_and_each_gets_its_own_responses(srv) -> None:
    async def run() -> dict[str, list[tuple[int, int]]]:
        client = grpcaio.InferenceServerClient(srv.grpc_url)
        requests = {f"q{i}": list(range(10 * i, 10 * i + 5)) for i in range(6)}

        async def messages():
            for rid, values in requests.items():
                yield {
                    "model_name": "repeat",
                    "inputs": [_in(values, grpcaio)],
                    "request_id": rid,
                    "enable_empty_final_response": True,
                    "parameters": {"delay_ms": 1},
                }

        got: dict[str, list[tuple[int, int]]] = {rid: [] for rid in requests}
        ended = 0
        try:
            async for result, error in client.stream_infer(inputs_iterator=messages()):
                assert error is None
                response = result.get_response()
                if response.parameters[FINAL].bool_param:
                    ended += 1
                    if ended == len(requests):
                        break
                    continue
                idx, out = result.as_numpy("IDX"), result.as_numpy("OUT")
                got[response.id].append((int(idx[0, 0]), int(out[0, 0])))
        finally:
            await client.close()
        return got

    got = asyncio.run(run())
    for i in range(6):
        assert got[f"q{i}"] == [(k, 10 * i + k) for k in range(5)]


def test_a_cancelled_aio_stream_closes_the_generator(srv) -> None:
    before = _metric(srv, "aserve_handler_repeat_closed")

    async def run() -> int:
        client = grpcaio.InferenceServerClient(srv.grpc_url)

        async def messages():
            yield {
                "model_name": "repeat", "inputs": [_in([1, 2], grpcaio)],
                "request_id": "endless", "parameters": {"endless": True},
            }  # fmt: skip
            await asyncio.Event().wait()  # the stream stays open until it is cancelled

        taken = 0
        calls = client.stream_infer(inputs_iterator=messages())
        async for _result, error in calls:
            assert error is None
            taken += 1
            if taken == 3:
                calls.cancel()
                break
        await client.close()
        return taken

    assert asyncio.run(run()) == 3
    _wait_metric(srv, "aserve_handler_repeat_closed", before + 1)


# --- HTTP: generate_stream, generate, the infer routes -------------------------------


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]


def test_generate_stream_sends_an_event_per_response(srv) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"id": "g1", "IN": [3, 1, 4]}
            async with session.post(srv.base + "/v2/models/repeat/generate_stream", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                events = _events(await r.read())
            assert events == [
                {"id": "g1", "model_name": "repeat", "model_version": "1", "OUT": v, "IDX": i}
                for i, v in enumerate([3, 1, 4])
            ]
            # One element given as a value; /generate answers the one response.
            async with session.post(srv.base + "/v2/models/repeat/generate", json={"IN": 5}) as r:
                assert r.status == 200
                assert await r.json() == {
                    "model_name": "repeat", "model_version": "1", "OUT": 5, "IDX": 0
                }  # fmt: skip
            async with session.post(
                srv.base + "/v2/models/repeat/generate", json={"IN": [5, 6]}
            ) as r:
                assert r.status == 400
                assert (await r.json())["error"] == (
                    "model 'repeat' answered with 2 responses; generate sends exactly one: "
                    "use generate_stream"
                )
            # A failure after the first event is the last event.
            body = {"IN": [1, 2, 3], "fail_at": 1}
            async with session.post(srv.base + "/v2/models/repeat/generate_stream", json=body) as r:
                events = _events(await r.read())
            assert events[0]["OUT"] == 1
            assert events[1] == {
                "error": "model 'repeat/1' stream failed: ValueError: asked to fail after 1 responses"
            }
            assert len(events) == 2

    asyncio.run(run())


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"id": "x"}, 400, "missing input(s) IN for model 'repeat'"),
        ({"IN": [[1], [2]]}, 400, "a value of shape [2, 1] does not fit the input's shape [-1]"),
        ({"IN": [1.5]}, 400, "input 'IN'"),
        ({"IN": [1], "parameters": 3}, 400, "field 'parameters' must be an object"),
        ({"IN": [1], "timeout_ms": "soon"}, 400, "timeout_ms"),
    ],
)
def test_generate_refuses_a_bad_request_naming_what_is_wrong(
    srv, body: dict[str, Any], status: int, message: str
) -> None:
    async def run() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            url = srv.base + "/v2/models/repeat/generate_stream"
            async with session.post(url, json=body) as r:
                return r.status, (await r.json())["error"]

    got_status, error = asyncio.run(run())
    assert got_status == status and message in error, error


def test_a_client_that_goes_closes_the_generator_over_http(srv) -> None:
    before = _metric(srv, "aserve_handler_repeat_closed")

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"IN": [1, 2], "endless": True}
            async with session.post(srv.base + "/v2/models/repeat/generate_stream", json=body) as r:
                lines = 0
                async for line in r.content:
                    lines += line.startswith(b"data: ")
                    if lines == 3:
                        break  # leaving unread closes the connection

    asyncio.run(run())
    _wait_metric(srv, "aserve_handler_repeat_closed", before + 1)


def test_the_infer_routes_refuse_a_decoupled_model_naming_the_streaming_ones(srv) -> None:
    http = httpclient.InferenceServerClient(srv.url)
    tensor = httpclient.InferInput("IN", [1, 2], "INT32")
    tensor.set_data_from_numpy(np.array([[1, 2]], np.int32))
    with pytest.raises(InferenceServerException) as refused:
        http.infer("repeat", [tensor])
    assert refused.value.status() == "400"
    assert "model 'repeat/1' is decoupled" in refused.value.message()
    assert "ModelStreamInfer" in refused.value.message()
    config = http.get_model_config("repeat")
    http.close()
    assert config["model_transaction_policy"] == {"decoupled": True}
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.infer("repeat", [_in([1, 2])])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "generate_stream" in refused.value.message()
    config = grpc_client.get_model_config("repeat").config
    grpc_client.close()
    assert config.model_transaction_policy.decoupled is True


def test_a_request_waiting_past_its_deadline_for_a_thread_is_refused(srv) -> None:
    """repeat_one runs one stream at a time: while an endless stream holds its
    thread, a request with a short timeout waits, then fails with the reason;
    the stream goes on, and the endless request ends when the call is cancelled."""
    stream = _Stream(srv)
    try:
        stream.client.async_stream_infer(
            "repeat_one", [_in([1])], request_id="holder", parameters={"endless": True}
        )
        stream.take(1)  # it runs: the thread is taken
        stream.client.async_stream_infer(
            "repeat_one",
            [_in([2])],
            request_id="late",
            timeout=100_000,  # µs
        )
        while True:  # the holder's responses, until the late one's error
            result, error = stream.results.get(timeout=30)
            if error is not None:
                break
            assert result.get_response().id == "holder"
    finally:
        stream.client.stop_stream(cancel_requests=True)
        stream.client.close()
    assert error.message() == (
        "request deadline passed waiting for one of model 'repeat_one/1''s 1 stream(s)"
    )
    deadline = time.monotonic() + 30
    while _stats(srv, "repeat_one")["running_batch_count"]:
        assert time.monotonic() < deadline, "the cancelled stream's generator still runs"
        time.sleep(0.02)


def _wait_pending(server: ServerProcess, model: str, want: int) -> None:
    deadline = time.monotonic() + 30
    while _stats(server, model)["pending_request_count"] != want:
        assert time.monotonic() < deadline, f"{model} never had {want} request(s) waiting"
        time.sleep(0.02)


def _stats(server: ServerProcess, model: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as r:
        return orjson.loads(r.read())["model_stats"][0]


def test_a_full_queue_over_http_is_a_429_naming_the_limit(srv, tmp_path: Path) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            url = srv.base + "/v2/models/repeat_one/generate_stream"
            holder = await session.post(url, json={"IN": [1], "endless": True})
            await holder.content.readline()  # its first event: it holds the thread
            waiter = asyncio.ensure_future(session.post(url, json={"IN": [2]}))
            await asyncio.to_thread(_wait_pending, srv, "repeat_one", 1)
            async with session.post(url, json={"IN": [3]}) as r:
                assert r.status == 429
                assert (await r.json())["error"] == (
                    "model 'repeat_one/1': 1 requests wait for one of its 1 stream(s) "
                    "(max_queue_size 1)"
                )
            holder.close()  # the client goes: the endless stream ends, the waiter runs
            response = await waiter
            assert _events(await response.read()) == [
                {"model_name": "repeat_one", "model_version": "1", "OUT": 2, "IDX": 0}
            ]

    asyncio.run(run())
    stats = _stats(srv, "repeat_one")
    assert stats["rejected"]["queue_full"] >= 1 and stats["response_count"] >= 2


# --- the config ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"engine": "torch", "path": "m.pt", "handler": None},
            "decoupled: only for engine 'python'",
        ),
        ({"executor": "process"}, "decoupled: a decoupled handler's streams run in the server's"),
        ({"load": "on_demand"}, "decoupled: a decoupled model loads at startup"),
    ],
)
def test_the_config_refuses_what_a_decoupled_model_cannot_be(
    extra: dict[str, Any], message: str
) -> None:
    from aserve.config import ModelConfig

    entry = {k: v for k, v in {**_repeat("r"), **extra}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.model_validate(entry)


def test_a_decoupled_handler_without_stream_is_refused_at_load(tmp_path: Path) -> None:
    from aserve.config import ModelConfig
    from aserve.engines.python_handler import HandlerImportError, import_handler

    copy_handler(tmp_path, "sleeper")
    config = ModelConfig.model_validate(_repeat("r", handler="sleeper:Sleeper"))
    with pytest.raises(HandlerImportError) as refused:
        import_handler(config.handler or "", tmp_path, config.decoupled)
    assert str(refused.value) == (
        "class 'sleeper:Sleeper' lacks method(s) stream; a decoupled model's handler needs "
        "load, stream"
    )


def test_a_stream_running_at_drain_timeout_ends_with_an_error_event(tmp_path: Path) -> None:
    import signal

    copy_handler(tmp_path, "repeat")
    config = {"models": [_repeat("repeat")], "drain_timeout_s": 1}
    server = start_server(write_config(tmp_path, config))

    async def scenario() -> list[dict[str, Any]]:
        body = {"IN": [1, 2], "endless": True, "delay_ms": 5}
        async with aiohttp.ClientSession() as session:
            url = server.base + "/v2/models/repeat/generate_stream"
            async with session.post(url, json=body) as r:
                await r.content.readuntil(b"\n\n")  # the stream is running
                server.proc.send_signal(signal.SIGTERM)
                raw = await asyncio.wait_for(r.content.read(), 30)
        return _events(raw)

    try:
        events = asyncio.run(scenario())
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert events[-1] == {"error": "model 'repeat/1' is unloading; the stream was cut off"}
    assert all("OUT" in e for e in events[:-1])
    assert "requests still in flight after drain_timeout_s (1 s)" in server.log_text()
