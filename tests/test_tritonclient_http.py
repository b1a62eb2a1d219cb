"""The released tritonclient (HTTP, sync) against a real server on loopback."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from helpers import mixed_arrays
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url, network_timeout=30)
    yield c
    c.close()


def _input(name, arr, binary):
    dtype = {np.float32: "FP32", np.float16: "FP16", np.float64: "FP64", np.int8: "INT8",
             np.int64: "INT64", np.uint8: "UINT8", np.bool_: "BOOL"}[arr.dtype.type]  # fmt: skip
    inp = httpclient.InferInput(name, list(arr.shape), dtype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("affine")
    assert client.is_model_ready("affine", "1")
    assert not client.is_model_ready("no-such-model")


def test_server_and_model_metadata(client):
    meta = client.get_server_metadata()
    assert meta["name"] == "aserve"
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("pair")
    assert model["name"] == "pair"
    assert model["inputs"] == [
        {"name": "A", "datatype": "FP32", "shape": [-1, 8]},
        {"name": "B", "datatype": "FP32", "shape": [-1, 8]},
    ]
    assert [o["name"] for o in model["outputs"]] == ["SUM", "DOT"]


@pytest.mark.parametrize("model", ["affine", "pair", "sleepy"])
def test_model_config_is_the_one_grpc_gives(client, grpc_client, model):
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    config = client.get_model_config(model)
    assert config == client.get_model_config(model, "1")
    grpc_json = grpc_client.get_model_config(model, as_json=True)["config"]
    # gRPC's JSON writes 64-bit integers as strings; both parse to the same message.
    as_message = [
        json_format.ParseDict(doc, model_config_pb2.ModelConfig()) for doc in (config, grpc_json)
    ]
    assert as_message[0] == as_message[1]
    assert config["name"] == model and "input" in config and "output" in config
    if model == "affine":
        assert config["max_batch_size"] == 32
        assert config["dynamic_batching"]["preferred_batch_size"] == [8, 16, 32]
        # A number, as Triton's HTTP server writes it (perf_analyzer reads it so).
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
        assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}]


def test_the_http_page_config_commands_work_as_written(client, server):
    """The HTTP API page's curl and tritonclient lines, on the default model's name."""
    page = Path(__file__).resolve().parent.parent / "docs" / "reference" / "http.md"
    block = re.search(r"```bash\n(.*?)```", page.read_text(), re.S)
    assert block, "the HTTP API page's model config commands are gone"
    curl, python = [shlex.split(line.partition("  #")[0]) for line in block.group(1).splitlines()]
    assert curl[:2] == ["curl", "-s"] and curl[2].startswith("localhost:8000/"), curl
    url = "http://" + curl[2].replace("localhost:8000", f"127.0.0.1:{server.port}")
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        got = json.loads(r.read())
    assert got == client.get_model_config("affine")
    assert python[:2] == [".venv/bin/python", "-c"], python
    code = python[2].replace("localhost:8000", f"127.0.0.1:{server.port}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert ast.literal_eval(done.stdout.strip()) == got


def test_unknown_model_config_raises_404(client):
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_config("nope")
    assert exc.value.status() == "404"
    assert "nope" in exc.value.message()
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_config("affine", "7")
    assert exc.value.status() == "404"


def test_unknown_model_metadata_raises_404(client):
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_metadata("nope")
    assert exc.value.status() == "404"
    assert "nope" in exc.value.message()


@pytest.mark.parametrize("binary_in", [False, True], ids=["json-in", "binary-in"])
@pytest.mark.parametrize("binary_out", [False, True], ids=["json-out", "binary-out"])
def test_infer_torchscript(client, eager_models, binary_in, binary_out):
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    result = client.infer(
        "affine",
        [_input("INPUT0", x, binary_in)],
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out)],
        request_id="req-42",
    )
    expected = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), expected, rtol=1e-5, atol=1e-5)
    response = result.get_response()
    assert response["id"] == "req-42"
    assert response["model_name"] == "affine"
    out = response["outputs"][0]
    assert ("binary_data_size" in out.get("parameters", {})) == binary_out


def test_infer_exported_program_two_inputs_two_outputs(client, eager_models):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((3, 8)).astype(np.float32)
    # Default outputs (none requested): the client asks for all of them as binary.
    result = client.infer("pair", [_input("A", a, True), _input("B", b, False)])
    expected = eager_models["pair"](torch.from_numpy(a), torch.from_numpy(b))
    np.testing.assert_allclose(result.as_numpy("SUM"), expected["SUM"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(result.as_numpy("DOT"), expected["DOT"].numpy(), rtol=1e-5)
    # One output, mixed with the other left out.
    only = client.infer(
        "pair",
        [_input("A", a, False), _input("B", b, True)],
        outputs=[httpclient.InferRequestedOutput("DOT", binary_data=False)],
    )
    assert only.as_numpy("SUM") is None
    np.testing.assert_allclose(only.as_numpy("DOT"), expected["DOT"].numpy(), rtol=1e-5)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_every_numeric_datatype(client, eager_models, binary):
    arrays = mixed_arrays()
    # JSON cannot carry FP16 for tritonclient: that one always goes binary.
    inputs = [_input(f"IN_{k}", v, binary or k == "HALF") for k, v in arrays.items()]
    outputs = [httpclient.InferRequestedOutput(f"OUT_{k}", binary_data=binary or k == "HALF")
               for k in arrays]  # fmt: skip
    result = client.infer("mixed", inputs, outputs=outputs)
    expected = eager_models["mixed"](*[torch.from_numpy(v) for v in arrays.values()])
    for name, want in zip(arrays, expected, strict=True):
        got = result.as_numpy(f"OUT_{name}")
        assert got.dtype == want.numpy().dtype, name
        np.testing.assert_array_equal(got, want.numpy(), err_msg=name)


def test_statistics_extension(client):
    client.infer("affine", [_input("INPUT0", np.zeros((1, 16), np.float32), True)])
    stats = client.get_inference_statistics("affine")["model_stats"][0]
    assert stats["name"] == "affine"
    assert stats["inference_count"] >= 1
    assert stats["execution_count"] >= 1
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["inference_stats"]["queue"]["ns"] >= 0
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    assert any(b["batch_size"] == 1 for b in stats["batch_stats"])


def test_bad_input_surfaces_as_exception_with_message(client):
    x = np.zeros((1, 15), np.float32)
    with pytest.raises(InferenceServerException) as exc:
        client.infer("affine", [_input("INPUT0", x, True)])
    assert exc.value.status() == "400"
    assert "INPUT0" in exc.value.message()
