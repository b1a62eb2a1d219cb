"""The released tritonclient.grpc (sync and asyncio) against a real server on loopback."""

from __future__ import annotations

import asyncio
import queue

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from helpers import grpc_input, mixed_arrays, sync_stats
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def _affine(eager_models, x: np.ndarray) -> np.ndarray:
    return eager_models["affine"](torch.from_numpy(x)).detach().numpy()


def test_health_and_readiness(grpc_client):
    assert grpc_client.is_server_live()
    assert grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("affine")
    assert grpc_client.is_model_ready("affine", "1")
    assert not grpc_client.is_model_ready("affine", "7")
    assert not grpc_client.is_model_ready("no-such-model")


def test_server_and_model_metadata(grpc_client):
    meta = grpc_client.get_server_metadata()
    assert meta.name == "aserve"
    assert "statistics" in meta.extensions
    model = grpc_client.get_model_metadata("pair", as_json=True)
    assert model["name"] == "pair" and model["versions"] == ["1"]
    assert model["platform"] == "pytorch_export"  # a torch.export program (.pt2)
    # int64 fields are strings in protobuf's JSON form.
    assert model["inputs"] == [
        {"name": "A", "datatype": "FP32", "shape": ["-1", "8"]},
        {"name": "B", "datatype": "FP32", "shape": ["-1", "8"]},
    ]
    assert [o["name"] for o in model["outputs"]] == ["SUM", "DOT"]
    with pytest.raises(InferenceServerException) as exc:
        grpc_client.get_model_metadata("nope")
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    assert "nope" in exc.value.message()


def test_model_config_statistics_and_repository_index(grpc_client):
    config = grpc_client.get_model_config("affine").config
    assert config.name == "affine" and config.max_batch_size == 32
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("INPUT0", 11, [16])]
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16, 32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000

    grpc_client.infer("affine", [grpc_input("INPUT0", np.zeros((1, 16), np.float32))])
    stats = grpc_client.get_inference_statistics("affine").model_stats
    assert [s.name for s in stats] == ["affine"]
    assert stats[0].inference_count >= 1 and stats[0].inference_stats.success.count >= 1
    assert stats[0].inference_stats.compute_infer.ns > 0
    everything = grpc_client.get_inference_statistics()
    assert {"affine", "pair", "spin"} <= {s.name for s in everything.model_stats}

    index = grpc_client.get_model_repository_index(as_json=True)["models"]
    assert {"name": "affine", "version": "1", "state": "READY"} in index


def test_infer_raw_inputs_as_tritonclient_sends_them(grpc_client, eager_models):
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    result = grpc_client.infer(
        "affine", [grpc_input("INPUT0", x)],
        outputs=[grpcclient.InferRequestedOutput("OUTPUT0")], request_id="req-42",
    )  # fmt: skip
    np.testing.assert_allclose(
        result.as_numpy("OUTPUT0"), _affine(eager_models, x), rtol=1e-5, atol=1e-5
    )
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-42", "affine", "1")
    assert len(response.raw_output_contents) == 1, "a raw request is answered raw"


def test_infer_two_inputs_two_outputs_and_an_output_subset(grpc_client, eager_models):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((3, 8)).astype(np.float32)
    expected = eager_models["pair"](torch.from_numpy(a), torch.from_numpy(b))
    result = grpc_client.infer("pair", [grpc_input("A", a), grpc_input("B", b)])
    np.testing.assert_allclose(result.as_numpy("SUM"), expected["SUM"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(result.as_numpy("DOT"), expected["DOT"].numpy(), rtol=1e-5)
    only = grpc_client.infer("pair", [grpc_input("A", a), grpc_input("B", b)],
                        outputs=[grpcclient.InferRequestedOutput("DOT")])  # fmt: skip
    assert only.as_numpy("SUM") is None
    np.testing.assert_allclose(only.as_numpy("DOT"), expected["DOT"].numpy(), rtol=1e-5)


def test_infer_every_numeric_datatype(grpc_client, eager_models):
    arrays = mixed_arrays()
    result = grpc_client.infer("mixed", [grpc_input(f"IN_{k}", v) for k, v in arrays.items()])
    expected = eager_models["mixed"](*[torch.from_numpy(v) for v in arrays.values()])
    for name, want in zip(arrays, expected, strict=True):
        got = result.as_numpy(f"OUT_{name}")
        assert got.dtype == want.numpy().dtype, name
        np.testing.assert_array_equal(got, want.numpy(), err_msg=name)


def test_infer_with_typed_contents_is_answered_raw(server, eager_models):
    """Clients other than tritonclient (KServe SDK, grpcurl) send typed contents; the
    answer is raw all the same, as Triton's is (clients written against its protobuf
    read only raw_output_contents)."""
    x = np.random.default_rng(6).standard_normal((2, 16)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="affine", id="typed-1")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, 16])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=10
        )
    assert response.id == "typed-1" and len(response.raw_output_contents) == 1
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("OUTPUT0", "FP32", [2, 16])
    assert not out.HasField("contents")
    got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 16)
    np.testing.assert_allclose(got, _affine(eager_models, x), rtol=1e-5, atol=1e-5)


def test_async_infer_answers_each_request(server, grpc_client, eager_models):
    before = sync_stats(server.base, "affine")
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(32)]
    done: queue.Queue = queue.Queue()
    for i, x in enumerate(xs):
        grpc_client.async_infer(
            "affine", [grpc_input("INPUT0", x)], request_id=str(i),
            callback=lambda result, error: done.put((result, error)),
        )  # fmt: skip
    results = [done.get(timeout=30) for _ in xs]
    for result, error in results:
        assert error is None, error
        i = int(result.get_response().id)
        np.testing.assert_allclose(
            result.as_numpy("OUTPUT0"), _affine(eager_models, xs[i]), rtol=1e-5, atol=1e-5
        )
    after = sync_stats(server.base, "affine")
    assert after["inference_count"] - before["inference_count"] == 32


def test_stream_of_100_requests_all_answered_correctly(grpc_client, eager_models):
    # That the 100 are in flight at once, not one after the other, is shown
    # by test_grpc_server.py::test_one_stream_keeps_100_requests_in_flight.
    rng = np.random.default_rng(8)
    xs = {f"s-{i}": rng.standard_normal((1, 16)).astype(np.float32) for i in range(100)}
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id, x in xs.items():
            grpc_client.async_stream_infer(
                "affine", [grpc_input("INPUT0", x)], request_id=request_id
            )
    finally:
        grpc_client.stop_stream()  # half-closes; returns once the server answered all and ended OK
    seen = {}
    while not responses.empty():
        result, error = responses.get_nowait()
        assert error is None, error
        response = result.get_response()
        assert response.parameters["triton_final_response"].bool_param
        seen[response.id] = result.as_numpy("OUTPUT0")
    assert set(seen) == set(xs)
    for request_id, x in xs.items():
        np.testing.assert_allclose(seen[request_id], _affine(eager_models, x), rtol=1e-5, atol=1e-5)


def test_stream_reports_per_request_errors_and_keeps_going(grpc_client):
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    good = np.ones((1, 16), np.float32)
    try:
        grpc_client.async_stream_infer("affine", [grpc_input("INPUT0", good)], request_id="ok-1")
        grpc_client.async_stream_infer("nope", [grpc_input("INPUT0", good)], request_id="bad-model")
        grpc_client.async_stream_infer("affine", [grpc_input("INPUT0", np.ones((1, 3), np.float32))],
                                  request_id="bad-shape")  # fmt: skip
        grpc_client.async_stream_infer("affine", [grpc_input("INPUT0", good)], request_id="ok-2",
                                  enable_empty_final_response=True)  # fmt: skip
    finally:
        grpc_client.stop_stream()
    results, errors = [], []
    while not responses.empty():
        result, error = responses.get_nowait()
        (errors if error is not None else results).append(error or result)
    assert sorted(str(e) for e in errors) == sorted(
        [
            "Request for unknown model: 'nope' is not found",
            "input 'INPUT0': shape [1, 3] does not match the model's [batch, 16]",
        ]
    )
    by_id: dict[str, list] = {}
    for r in results:
        by_id.setdefault(r.get_response().id, []).append(r)
    assert sorted(by_id) == ["ok-1", "ok-2"]
    # enable_empty_final_response: a data response, then an empty final one.
    data, final = by_id["ok-2"]
    assert not data.get_response().parameters["triton_final_response"].bool_param
    assert final.get_response().parameters["triton_final_response"].bool_param
    assert final.as_numpy("OUTPUT0") is None and data.as_numpy("OUTPUT0") is not None


def test_aio_client_infer_and_stream_infer(server, eager_models):
    rng = np.random.default_rng(9)
    xs = {f"a-{i}": rng.standard_normal((1, 16)).astype(np.float32) for i in range(100)}

    async def scenario():
        async with grpcaio.InferenceServerClient(server.grpc_url) as c:
            assert await c.is_server_ready()
            assert await c.is_model_ready("pair")
            single = await c.infer("affine", [grpc_input("INPUT0", xs["a-0"])], request_id="one")

            async def requests():
                for request_id, x in xs.items():
                    yield {
                        "model_name": "affine",
                        "inputs": [grpc_input("INPUT0", x)],
                        "request_id": request_id,
                    }

            streamed = {}
            async for result, error in c.stream_infer(requests()):
                assert error is None, error
                streamed[result.get_response().id] = result.as_numpy("OUTPUT0")
            return single, streamed

    single, streamed = asyncio.run(scenario())
    assert single.get_response().id == "one"
    np.testing.assert_allclose(
        single.as_numpy("OUTPUT0"), _affine(eager_models, xs["a-0"]), rtol=1e-5, atol=1e-5
    )
    assert set(streamed) == set(xs)
    for request_id, x in xs.items():
        np.testing.assert_allclose(
            streamed[request_id], _affine(eager_models, x), rtol=1e-5, atol=1e-5
        )
