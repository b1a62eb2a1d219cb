"""Server behaviour over gRPC: deadlines, cancellation, error codes, health, reflection, drain."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from conftest import model_entry, spec, start_server, write_config
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers import frozen, grpc_input, sync_stats, sync_wait_for_stats
from tritonclient.utils import InferenceServerException

from aserve.errors import ErrorCode
from aserve.frontends import status
from aserve.frontends.http import kit as http

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _spin(name: str, **batching) -> dict:
    batching = {"max_batch_size": 4, "max_delay_ms": 0, "timeout_ms": 60000, **batching}
    return model_entry(
        name, "spin.pt", [spec("X", "FP32", [-1])], [spec("Y", "FP32", [1])], batching=batching,
        executor="process",  # so that a test can hold a batch running (helpers.frozen)
    )  # fmt: skip


@pytest.fixture(scope="module")
def spin_server(model_dir):
    """A server of its own for the tests that hold spin busy with a frozen batch.

    A held batch teaches a model's batcher that a batch takes long, after
    which admission refuses short deadlines at once (UNAVAILABLE); the session
    server's spin must keep its warm-up estimates for the HTTP tests. The two
    tests that need a deadline to expire in the queue get a fresh copy each;
    spin_many batches up to 128.
    """
    config = {
        "grpc": {"port": 0},
        "models": [
            _spin("spin", max_queue_size=2),
            _spin("spin_deadline"),
            _spin("spin_timeout"),
            _spin("spin_many", max_batch_size=128),
        ],
    }
    srv = start_server(write_config(model_dir, config, name="grpc-spin.json"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def spin_client(spin_server):
    c = grpcclient.InferenceServerClient(spin_server.grpc_url)
    yield c
    c.close()


def _x(width: int, value: float = 1.0) -> list[grpcclient.InferInput]:
    return [grpc_input("X", np.full((1, width), value, np.float32))]


def _stats(server, model: str) -> dict:
    return sync_stats(server.base, model)


def _wait_stats(server, model: str, check) -> dict:
    return sync_wait_for_stats(server.base, model, check)


def _idle(s: dict) -> bool:
    return s["pending_request_count"] == 0 and s["running_batch_count"] == 0


@contextlib.contextmanager
def _held(server, client, model: str = "spin") -> Iterator[queue.Queue]:
    """Occupy the model's only instance: one request runs on its frozen worker until
    the block ends. Yields the queue its answer lands in, after the block."""
    _wait_stats(server, model, _idle)
    done: queue.Queue = queue.Queue()
    with frozen(server.worker_pid(model)):
        client.async_infer(
            model, _x(2, 0.25), callback=lambda result, error: done.put((result, error))
        )
        _wait_stats(server, model, lambda s: s["running_batch_count"] == 1)
        yield done


def _held_answer(done: queue.Queue) -> None:
    result, error = done.get(timeout=30)
    assert error is None, error
    assert result.as_numpy("Y")[0, 0] == pytest.approx(0.5)


def _status(exc: pytest.ExceptionInfo) -> str:
    return exc.value.status()


# --- deadlines and cancellation -----------------------------------------------


def test_the_grpc_deadline_becomes_the_request_deadline(grpc_client):
    # sleepy sleeps 1 s per batch (measured at warm-up; more on a busy machine).
    # With 300 ms left, admission refuses at once; had the deadline not been
    # passed on, the model's 5 s default would have let it run.
    with pytest.raises(InferenceServerException) as exc:
        grpc_client.infer("sleepy", _x(2), client_timeout=0.3)
    assert _status(exc) == "StatusCode.UNAVAILABLE"
    assert "cannot meet the request's deadline" in exc.value.message()
    assert grpc_client.infer("sleepy", _x(2), client_timeout=30).as_numpy("Y")[0, 0] == 2.0


def test_deadline_expiry_while_queued_frees_the_queue(spin_server, spin_client):
    server, client, model = spin_server, spin_client, "spin_deadline"
    with _held(server, client, model) as held:
        before = _stats(server, model)
        with pytest.raises(InferenceServerException) as exc:
            client.infer(model, _x(1), client_timeout=0.5)
        assert _status(exc) == "StatusCode.DEADLINE_EXCEEDED"
        gone = _wait_stats(server, model, lambda s: s["pending_request_count"] == 0)
        # The batcher's timer or the call's cancellation, whichever came first, took it out.
        left = (gone["timed_out"] - before["timed_out"]) + (gone["cancelled"] - before["cancelled"])
        assert left == 1
        assert held.empty(), "the expiry waited for the running batch"
    _held_answer(held)
    idle = _wait_stats(server, model, _idle)
    assert idle["inference_count"] == before["inference_count"] + 1  # only the held request ran


def test_timeout_parameter_expires_with_the_servers_message(spin_server, spin_client):
    server, client, model = spin_server, spin_client, "spin_timeout"
    with _held(server, client, model) as held:
        before = _stats(server, model)
        with pytest.raises(InferenceServerException) as exc:
            client.infer(model, _x(1), timeout=100_000)  # Triton's parameter: microseconds
        assert _status(exc) == "StatusCode.DEADLINE_EXCEEDED"
        assert "timed out" in exc.value.message() and f"{model}/1" in exc.value.message()
        assert _stats(server, model)["timed_out"] == before["timed_out"] + 1
    _held_answer(held)


def test_client_cancel_takes_the_request_out_of_the_queue(spin_server, spin_client):
    server, client = spin_server, spin_client
    with _held(server, client) as held:
        before = _stats(server, "spin")
        answers: queue.Queue = queue.Queue()
        call = client.async_infer("spin", _x(1), callback=lambda result, error: answers.put(error))
        _wait_stats(server, "spin", lambda s: s["pending_request_count"] == 1)
        call.cancel()
        error = answers.get(timeout=10)
        assert error is not None and "CANCELLED" in f"{error.status()} {error}".upper()
        gone = _wait_stats(server, "spin", lambda s: s["pending_request_count"] == 0)
        assert gone["cancelled"] == before["cancelled"] + 1
        assert held.empty(), "the cancel waited for the running batch"
    _held_answer(held)
    idle = _wait_stats(server, "spin", _idle)
    assert idle["inference_count"] == before["inference_count"] + 1


def test_cancelled_stream_takes_its_requests_out_of_the_queue(spin_server, spin_client):
    server, client = spin_server, spin_client

    async def scenario():
        async with grpcaio.InferenceServerClient(server.grpc_url) as aio:

            async def requests():
                for i in range(2):  # spin's max_queue_size
                    yield {"model_name": "spin", "inputs": _x(1), "request_id": f"q-{i}"}
                await asyncio.sleep(3600)  # keep the stream open, as a live client would

            stream = aio.stream_infer(requests())
            reading = asyncio.ensure_future(stream.__anext__())
            await asyncio.to_thread(
                _wait_stats, server, "spin", lambda s: s["pending_request_count"] == 2
            )
            stream.cancel()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    with _held(server, client) as held:
        before = _stats(server, "spin")
        asyncio.run(scenario())
        gone = _wait_stats(server, "spin", lambda s: s["pending_request_count"] == 0)
        assert gone["cancelled"] == before["cancelled"] + 2
        assert held.empty(), "the cancel waited for the running batch"
    _held_answer(held)


def test_one_stream_keeps_100_requests_in_flight(spin_server, spin_client):
    """99 requests wait in the queue together behind a held one, all from one stream."""
    server, client, model = spin_server, spin_client, "spin_many"
    before = _wait_stats(server, model, _idle)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        with frozen(server.worker_pid(model)):
            client.async_stream_infer(model, _x(2, 0.25), request_id="held")
            _wait_stats(server, model, lambda s: s["running_batch_count"] == 1)
            for i in range(99):
                client.async_stream_infer(model, _x(1, float(i)), request_id=f"r-{i}")
            # Had the stream taken one request at a time, at most one would wait.
            _wait_stats(server, model, lambda s: s["pending_request_count"] == 99)
    finally:
        client.stop_stream()  # waits for the stream's answers
    answers = {}
    while not responses.empty():
        result, error = responses.get_nowait()
        assert error is None, error
        answers[result.get_response().id] = result.as_numpy("Y")[0, 0]
    assert answers == {"held": 0.5, **{f"r-{i}": float(i) for i in range(99)}}
    after = _wait_stats(server, model, _idle)
    assert after["inference_count"] - before["inference_count"] == 100
    assert (
        after["execution_count"] - before["execution_count"] == 2
    )  # the held one, then 99 as one batch


# --- error codes ----------------------------------------------------------------


def test_status_table_is_one_for_both_frontends():
    assert http.HTTP_STATUS is status.HTTP_STATUS
    assert set(status.STATUS) == set(ErrorCode)
    want = {
        ErrorCode.INVALID_ARGUMENT: (400, grpc.StatusCode.INVALID_ARGUMENT),
        ErrorCode.NOT_FOUND: (404, grpc.StatusCode.NOT_FOUND),
        ErrorCode.TOO_LARGE: (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ErrorCode.QUEUE_FULL: (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ErrorCode.UNAVAILABLE: (503, grpc.StatusCode.UNAVAILABLE),
        ErrorCode.DEADLINE_EXCEEDED: (504, grpc.StatusCode.DEADLINE_EXCEEDED),
        ErrorCode.CANCELLED: (499, grpc.StatusCode.CANCELLED),
        ErrorCode.REQUEST_TIMEOUT: (408, grpc.StatusCode.DEADLINE_EXCEEDED),
        ErrorCode.UNIMPLEMENTED: (501, grpc.StatusCode.UNIMPLEMENTED),
        ErrorCode.INTERNAL: (500, grpc.StatusCode.INTERNAL),
    }
    assert {code: tuple(s) for code, s in status.STATUS.items()} == want


BAD_CALLS = [
    # (case, call, gRPC status, words the message must contain)
    ("wrong shape", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((1, 15), np.float32))]),
     "INVALID_ARGUMENT", ["INPUT0", "shape"]),
    ("wrong datatype", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((1, 16), np.int32))]),
     "INVALID_ARGUMENT", ["INPUT0", "INT32", "FP32"]),
    ("missing input", lambda c: c.infer("pair", [grpc_input("A", np.ones((1, 8), np.float32))]),
     "INVALID_ARGUMENT", ["missing input", "B"]),
    ("batch too big", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((33, 16), np.float32))]),
     "INVALID_ARGUMENT", ["batch size 33", "max_batch_size 32"]),
    ("unknown output", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((1, 16), np.float32))],
                                         outputs=[grpcclient.InferRequestedOutput("NOPE")]),
     "INVALID_ARGUMENT", ["NOPE", "OUTPUT0"]),
    ("bad timeout", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((1, 16), np.float32))],
                                      parameters={"timeout_ms": -1}),
     "INVALID_ARGUMENT", ["timeout_ms"]),
    ("unknown model", lambda c: c.infer("nosuch", _x(1)), "NOT_FOUND", ["nosuch"]),
    ("unknown version", lambda c: c.infer("affine", _x(1), model_version="9"), "NOT_FOUND",
     ["Request for unknown model: 'affine' version 9 is not found"]),
    ("sequence", lambda c: c.infer("affine", [grpc_input("INPUT0", np.ones((1, 16), np.float32))], sequence_id=5),
     "UNIMPLEMENTED", ["sequence"]),
    ("unknown rpc", lambda c: c.get_log_settings(), "UNIMPLEMENTED", []),
    ("over max_request_bytes", lambda c: c.infer("spin", _x(600_000)), "RESOURCE_EXHAUSTED", []),
    ("model failed", lambda c: c.infer("fussy", [grpc_input("X", np.array([[1.0, -1.0]], np.float32))]),
     "INTERNAL", ["fussy/1", "negative input"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "call", "code", "words"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_each_error_gets_its_grpc_status_and_a_message_naming_it(
    grpc_client, case, call, code, words
):
    with pytest.raises(InferenceServerException) as exc:
        call(grpc_client)
    assert _status(exc) == f"StatusCode.{code}", exc.value
    for word in words:
        assert word in exc.value.message(), f"{case}: {word!r} not in {exc.value.message()!r}"


def test_after_errors_the_same_models_still_serve(grpc_client):
    ok = grpc_client.infer("fussy", [grpc_input("X", np.array([[1.0, 2.0]], np.float32))])
    np.testing.assert_array_equal(ok.as_numpy("Y"), [[2.0, 4.0]])


def test_full_queue_is_resource_exhausted_at_once(spin_server, spin_client):
    server, client = spin_server, spin_client
    answers: queue.Queue = queue.Queue()
    with _held(server, client) as held:
        for _ in range(2):  # spin's max_queue_size
            client.async_infer("spin", _x(1), callback=lambda result, error: answers.put(error))
        _wait_stats(server, "spin", lambda s: s["pending_request_count"] == 2)
        with pytest.raises(InferenceServerException) as exc:
            client.infer("spin", _x(1))
        assert _status(exc) == "StatusCode.RESOURCE_EXHAUSTED"
        assert "max_queue_size 2" in exc.value.message()
        assert held.empty(), "the refusal waited for the running batch"
    _held_answer(held)
    assert [answers.get(timeout=30) for _ in range(2)] == [None, None]


# --- health and reflection --------------------------------------------------------


def test_health_check_overall_and_per_model(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def check(service: str) -> int:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        for service in ("", "inference.GRPCInferenceService", "affine", "affine/1", "spin"):
            assert check(service) == SERVING, service
        with pytest.raises(grpc.RpcError) as exc:
            check("nope")
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services  # fmt: skip
        pool = DescriptorPool(database)
        infer = pool.FindServiceByName("inference.GRPCInferenceService")
        stream = infer.methods_by_name["ModelStreamInfer"]
        assert stream.client_streaming and stream.server_streaming
        assert stream.output_type.full_name == "inference.ModelStreamInferResponse"
        request = pool.FindMessageTypeByName("inference.ModelInferRequest")
        assert request.fields_by_name["raw_input_contents"].number == 7
        assert pool.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]


# --- lifecycle ------------------------------------------------------------------


def _spin_config(model_dir, tmp_path, grpc_config: dict) -> object:
    entry = model_entry(
        "spin", "spin.pt", [spec("X", "FP32", [-1])], [spec("Y", "FP32", [1])],
        batching={"max_batch_size": 4, "timeout_ms": 60000}, executor="process",
    )  # fmt: skip
    config = {"models": [entry], "drain_timeout_s": 60, "grpc": grpc_config}
    return write_config(model_dir, config, name=f"grpc-{tmp_path.name}.json")


def test_drain_turns_health_not_serving_and_finishes_in_flight_calls(model_dir, tmp_path):
    server = start_server(_spin_config(model_dir, tmp_path, {"port": 0}))
    try:
        channel = grpc.insecure_channel(server.grpc_url)
        stub = health_pb2_grpc.HealthStub(channel)
        overall = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        model = stub.Watch(health_pb2.HealthCheckRequest(service="spin"))
        assert next(overall).status == SERVING
        assert next(model).status == SERVING
        client = grpcclient.InferenceServerClient(server.grpc_url)
        with _held(server, client) as held:
            server.proc.send_signal(signal.SIGTERM)
            assert next(overall).status == NOT_SERVING
            assert next(model).status == NOT_SERVING
            assert held.empty(), "health changed only after the in-flight call finished"
        t0 = time.monotonic()
        _held_answer(held)
        # The open health watches do not hold the drain for its 60 s.
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
        log = server.log_text()
        assert "SIGTERM received: draining" in log and "stopped" in log
        client.close()
        channel.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_grpc_port_in_use_exits_1_naming_the_address(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _spin_config(model_dir, tmp_path, {"host": "127.0.0.1", "port": port})
        result = subprocess.run(
            [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"gRPC cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
