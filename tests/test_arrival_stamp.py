"""A request's deadline counts from when its first bytes were read, not from
when its handler ran (docs/guide/batching.md, "A request's deadline").

Each test holds a request between its arrival and its handler for longer than
its deadline, in an order the test sets: the rest of its body sent only once
the server has its head, a pipelined request behind one that a handler holds
until the test lets it go, a gRPC call whose servicer starts only after the
loop was held. Such a request is refused DEADLINE_EXCEEDED; before, its
deadline began when its handler ran, and it was served. The same requests
with a long deadline are served, and a request on a connection kept alive
since an earlier answer has all of its own deadline.

The clients are raw sockets (HTTP: the bytes, and when each part goes, are the
test's) and grpc.aio, against an in-process server on loopback, whose state
(and the stamp it took) the test can look at to order what it does next.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from conftest import model_entry, spec
from inprocess import InProcessServer, in_process

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from aserve.frontends.grpc.arrival import ArrivalInterceptor, call_budget

pytestmark = pytest.mark.timeout(120)

HANDLERS = Path(__file__).parent / "handlers"
SHORT_MS = 300  # a deadline the test makes sure has passed before the handler runs
LONG_MS = 60_000  # one nothing here comes near
SETTLE_S = 30.0  # how long to wait for the server to reach a state (a watchdog only)
AFFINE = model_entry(
    "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
    batching={"max_batch_size": 8},
)  # fmt: skip
BODY = orjson.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]}
)


def _head(model: str, body: bytes, timeout_ms: int) -> bytes:
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"aserve-timeout-ms: {timeout_ms}\r\n\r\n"
    ).encode()


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, orjson.loads(await reader.readexactly(length))


async def _until(check: Callable[[], Any]) -> Any:
    """``check()``'s first true value, looked at until it comes (SETTLE_S at most)."""
    give_up = time.monotonic() + SETTLE_S
    while not (value := check()):
        assert time.monotonic() < give_up, "the server never got there"
        await asyncio.sleep(0.01)
    return value


async def _past(moment: float) -> None:
    """Return once ``time.monotonic()`` (the server's clock too) is past ``moment``."""
    await asyncio.sleep(max(0.0, moment - time.monotonic()) + 0.01)  # the loop's clock
    assert time.monotonic() > moment


def _connections(srv: InProcessServer) -> list[Any]:
    server = srv.server.http._runner.server
    assert server is not None
    return server.connections


@pytest.fixture
async def srv(model_dir: Path, tmp_path: Path) -> AsyncIterator[InProcessServer]:
    shutil.copy(HANDLERS / "held.py", tmp_path / "held.py")
    shutil.copy(model_dir / "affine.pt", tmp_path / "affine.pt")
    os.mkfifo(tmp_path / "gate")
    held = {
        "name": "held", "engine": "python", "handler": "held:Held",
        "parameters": {"gate": str(tmp_path / "gate"), "began": str(tmp_path / "began")},
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
    }  # fmt: skip
    config = {"grpc": {"host": "127.0.0.1", "port": 0}, "models": [AFFINE, held]}
    async with in_process(config, tmp_path) as server:
        try:
            yield server
        finally:
            _open_gate(tmp_path / "gate")  # a preprocess still waiting goes on


def _open_gate(gate: Path) -> bool:
    """Let a ``held`` preprocess that waits go on; False when none waits."""
    try:
        os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: nobody has it open for reading
        return False
    return True


# --- HTTP ---------------------------------------------------------------------------


@pytest.mark.parametrize(("timeout_ms", "status"), [(SHORT_MS, 504), (LONG_MS, 200)])
async def test_a_body_that_arrives_after_the_deadline_is_refused_though_the_head_was_in_time(
    srv: InProcessServer, timeout_ms: int, status: int
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    try:
        half = len(BODY) // 2
        writer.write(_head("affine", BODY, timeout_ms) + BODY[:half])
        await writer.drain()
        # Its head is in once its connection is serving a request (ConnectionGuard):
        # the stamp is at most now.
        await _until(lambda: srv.server.http.connections.serving == 1)
        head_in = time.monotonic()
        await _past(head_in + SHORT_MS / 1e3)
        writer.write(BODY[half:])
        got, answer = await _response(reader)
    finally:
        writer.close()
    assert got == status, answer
    if status == 504:
        assert "deadline already passed on arrival" in answer["error"], answer


async def test_a_pipelined_request_counts_from_its_bytes_not_from_its_turn(
    srv: InProcessServer, tmp_path: Path
) -> None:
    held = orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2],
                                     "data": [1.0, 2.0]}]})  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    try:
        # Two requests in one write: the second is read with the first, and waits
        # behind it for its handler (one request at a time on a connection).
        writer.write(_head("held", held, LONG_MS) + held + _head("affine", BODY, SHORT_MS) + BODY)
        await writer.drain()
        await _until((tmp_path / "began").exists)  # the first is in its handler
        connection = (await _until(lambda: [c for c in _connections(srv) if c._stamps]))[0]
        second_arrived = connection._stamps[0]  # the second's, parsed and waiting
        assert second_arrived <= time.monotonic()
        await _past(second_arrived + SHORT_MS / 1e3)
        assert _open_gate(tmp_path / "gate")
        first, first_answer = await _response(reader)
        second, second_answer = await _response(reader)
    finally:
        writer.close()
    assert first == 200, first_answer
    assert first_answer["outputs"][0]["data"] == [3.0]
    assert second == 504, second_answer
    assert "deadline already passed on arrival" in second_answer["error"], second_answer


@pytest.mark.parametrize("split", [False, True], ids=["whole", "body-in-two"])
async def test_the_next_request_on_a_kept_alive_connection_has_its_whole_deadline(
    srv: InProcessServer, split: bool
) -> None:
    # The first request's body may come in two parts: the connection must not hand
    # the time of its last part to the next request.
    budget_ms = 1000
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    try:
        head = _head("affine", BODY, LONG_MS)
        if split:
            writer.write(head + BODY[:10])
            await writer.drain()
            await _until(lambda: srv.server.http.connections.serving == 1)
            writer.write(BODY[10:])
        else:
            writer.write(head + BODY)
        first, _ = await _response(reader)
        answered = time.monotonic()
        await _past(answered + 1.5 * budget_ms / 1e3)  # the connection lies idle
        writer.write(_head("affine", BODY, budget_ms) + BODY)
        second, second_answer = await _response(reader)
    finally:
        writer.close()
    assert first == 200
    assert second == 200, second_answer


# --- gRPC ---------------------------------------------------------------------------

BUSY_S = 0.5  # the loop held after a call arrived: longer than SHORT_MS


@pytest.fixture
def busy_after_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gRPC call's interceptor, once it noted the call's arrival, holds the
    loop for BUSY_S, as other work on it would: the servicer starts that late."""
    note = ArrivalInterceptor.intercept_service

    async def held(self: ArrivalInterceptor, continuation: Any, details: Any) -> Any:
        handler = await note(self, continuation, details)
        time.sleep(BUSY_S)  # noqa: ASYNC251 - on the loop, on purpose
        return handler

    monkeypatch.setattr(ArrivalInterceptor, "intercept_service", held)


def _grpc_request(timeout_ms: int | None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name="affine",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(
                name="INPUT0", datatype="FP32", shape=[1, 16],
                contents=pb.InferTensorContents(fp32_contents=[1.0] * 16),
            )
        ],
    )  # fmt: skip
    if timeout_ms is not None:
        request.parameters["timeout_ms"].int64_param = timeout_ms
    return request


@pytest.mark.usefixtures("busy_after_arrival")
@pytest.mark.parametrize(
    ("timeout_ms", "call_timeout_s", "code"),
    [
        (SHORT_MS, None, grpc.StatusCode.DEADLINE_EXCEEDED),
        (LONG_MS, None, grpc.StatusCode.OK),
        # The call's own deadline is the client's: the wait is not counted twice.
        (None, 4 * BUSY_S, grpc.StatusCode.OK),
    ],
    ids=["short-parameter", "long-parameter", "call-deadline"],
)
async def test_a_grpc_call_counts_from_when_it_arrived(
    srv: InProcessServer, timeout_ms: int | None, call_timeout_s: float | None,
    code: grpc.StatusCode,
) -> None:  # fmt: skip
    assert srv.server.grpc is not None
    port = srv.server.grpc.addresses[0][1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            response = await stub.ModelInfer(_grpc_request(timeout_ms), timeout=call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == code, exc.details()
            assert "deadline already passed on arrival" in (exc.details() or "")
            return
    assert code == grpc.StatusCode.OK
    assert len(response.outputs) == 1


class _Context:
    """What call_budget reads of a servicer context: the call's time left."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


async def test_a_calls_deadline_counts_from_its_arrival_as_the_client_set_it() -> None:
    async def continuation(details: Any) -> str:
        return "the method's handler"

    before = time.monotonic()
    assert (
        await ArrivalInterceptor().intercept_service(continuation, None) == "the method's handler"
    )
    arrival, budget = call_budget(_Context(None))  # no deadline: only the arrival
    assert budget is None and arrival is not None and before <= arrival <= time.monotonic()
    await _past(arrival + 0.2)
    start = time.monotonic()
    again, budget = call_budget(_Context(1.0))
    end = time.monotonic()
    # The second left now, and the time since the arrival, which it has spent already.
    assert again == arrival and budget is not None
    assert 1.0 + (start - arrival) <= budget <= 1.0 + (end - arrival)
    # A call the interceptor did not see (a context of its own) counts from now.
    assert contextvars.Context().run(call_budget, _Context(1.0)) == (None, 1.0)
