"""The small things raw clients of Triton's protocols trip on, on a real server:
an unknown model's wording, an input given two ways, answers always raw."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from reload_helpers import get_json
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(120)

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/v2/models/nosuch", "Request for unknown model: 'nosuch' is not found"),
        ("/v2/models/nosuch/config", "Request for unknown model: 'nosuch' is not found"),
        (
            "/v2/models/affine/versions/7",
            "Request for unknown model: 'affine' version 7 is not found (versions: 1)",
        ),
    ],
)
def test_unknown_model_over_http_is_worded_as_tritons(server, path: str, message: str) -> None:
    status, doc = get_json(server.base + path)
    assert (status, doc) == (404, {"error": message})


def test_unknown_model_over_grpc_and_tritonclient_http(server, grpc_client) -> None:
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    with pytest.raises(InferenceServerException) as unknown:
        grpc_client.infer("nosuch", [inp])
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert unknown.value.message() == "Request for unknown model: 'nosuch' is not found"
    with pytest.raises(InferenceServerException) as unknown:
        grpc_client.get_model_metadata("affine", "7")
    assert unknown.value.message().startswith(
        "Request for unknown model: 'affine' version 7 is not found"
    )
    client = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_config("nosuch")
    client.close()
    assert unknown.value.status() == "404"
    assert unknown.value.message() == "Request for unknown model: 'nosuch' is not found"


def _call(server, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    with grpc.insecure_channel(server.grpc_url) as channel:
        return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)


def test_an_input_given_both_ways_is_refused_naming_it_and_the_model(server) -> None:
    request = service_pb2.ModelInferRequest(model_name="affine")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    tensor.contents.fp32_contents.extend(X.ravel().tolist())
    request.raw_input_contents.append(X.tobytes())
    with pytest.raises(grpc.RpcError) as refused:
        _call(server, request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "input 'INPUT0' of model 'affine' is given both as typed contents and in "
        "raw_input_contents; give it one way (a request with raw_input_contents has every "
        "input not in shared memory there)"
    )
    # Either way alone is answered, raw both times.
    del request.raw_input_contents[:]
    typed = _call(server, request)
    request.inputs[0].ClearField("contents")
    request.raw_input_contents.append(X.tobytes())
    raw = _call(server, request)
    assert len(typed.raw_output_contents) == len(raw.raw_output_contents) == 1
    assert typed.raw_output_contents[0] == raw.raw_output_contents[0]
    assert not typed.outputs[0].HasField("contents")
