"""The ONNX Runtime engine: unit tests of its pieces, then a real server and tritonclient.http.

The models are exported from the torch test models by the tests themselves
(``onnx_models.py``), so the served answers are compared with torch's.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript", reason="exporting test models needs onnxscript (dev extra)")

import tritonclient.http as httpclient  # noqa: E402
from conftest import model_entry, spec, start_server, write_config  # noqa: E402
from onnx_models import build_onnx  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from aserve.config import TensorSpec, parse_config  # noqa: E402
from aserve.engines.io_specs import ModelMismatch, ModelTensor, reconcile  # noqa: E402
from aserve.engines.onnx_engine import CPU, CUDA, OnnxEngine, choose_providers  # noqa: E402


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("onnx")
    build_onnx(folder)
    return folder


@pytest.fixture(scope="module")
def eager():
    from models import Affine
    from onnx_models import Mlp, PairTuple

    return {"affine": Affine().eval(), "pair": PairTuple().eval(), "mlp": Mlp().eval()}


def _onnx_entry(name: str, path: str, inputs=None, outputs=None, **extra):
    entry = {"name": name, "engine": "onnx", "path": path, **extra}
    if inputs is not None:
        entry["inputs"] = inputs
    if outputs is not None:
        entry["outputs"] = outputs
    return entry


def _config(path: str, **fields):
    return parse_config({"models": [_onnx_entry("m", path, **fields)]}).models[0]


# --- pure pieces ------------------------------------------------------------


def test_providers_follow_the_device():
    assert choose_providers("cpu", [CUDA, CPU]) == ([CPU], None)
    providers, warning = choose_providers("cuda:1", [CUDA, CPU])
    assert providers == [(CUDA, {"device_id": 1}), CPU] and warning is None
    assert choose_providers("cuda", [CUDA, CPU])[0][0] == (CUDA, {"device_id": 0})


def test_a_cuda_device_without_the_cuda_provider_runs_on_the_cpu_and_says_so():
    providers, warning = choose_providers("cuda:0", ["AzureExecutionProvider", CPU])
    assert providers == [CPU]
    assert "onnxruntime-gpu" in warning and "Running on the CPU" in warning


def _t(name, datatype, *dims):
    return ModelTensor(name, datatype, tuple(dims), datatype or "tensor(bfloat16)")


def _s(name, datatype, shape):
    return TensorSpec(name=name, datatype=datatype, shape=shape)


def test_reconcile_fills_in_specs_from_the_model():
    model = [_t("X", "FP32", None, 16), _t("L", "INT64", None, None)]
    specs = reconcile("inputs", [], model, 8)
    assert specs == [_s("X", "FP32", [16]), _s("L", "INT64", [-1])]


def test_reconcile_accepts_matching_declarations():
    model = [_t("X", "FP32", None, None, 4)]
    declared = [_s("X", "FP32", [7, 4])]  # a fixed size where the model's is dynamic is fine
    assert reconcile("inputs", declared, model, 8) == declared


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ([_s("X", "FP16", [16])], "input 'X': the config declares FP16, the model's is FP32"),
        ([_s("X", "FP32", [8])], "the config declares shape [8], the model's is [16]"),
        ([_s("X", "FP32", [-1])], "the config declares shape [-1], the model's is [16]"),
        ([_s("X", "FP32", [16, 1])], "shape [16, 1]"),
        ([_s("Y", "FP32", [16])], "the model has no input(s) Y"),
    ],
)
def test_reconcile_names_the_disagreement(declared, message):
    with pytest.raises(ModelMismatch) as exc:
        reconcile("inputs", declared, [_t("X", "FP32", None, 16)], 8)
    assert message in str(exc.value)


def test_reconcile_needs_every_input_but_outputs_may_be_a_subset():
    model = [_t("A", "FP32", None, 2), _t("B", "FP32", None, 2)]
    with pytest.raises(ModelMismatch, match="the config does not list B"):
        reconcile("inputs", [_s("A", "FP32", [2])], model, 4)
    assert reconcile("outputs", [_s("B", "FP32", [2])], model, 4, subset_ok=True)


def test_reconcile_refuses_a_fixed_batch_and_unserved_types():
    with pytest.raises(ModelMismatch, match="fixed batch dimension of 4: export the model"):
        reconcile("inputs", [], [_t("X", "FP32", 4, 3)], 8)
    with pytest.raises(ModelMismatch, match=r"or set batching.max_batch_size to 1"):
        reconcile("inputs", [], [_t("X", "FP32", 1, 3)], 8)
    assert reconcile("inputs", [], [_t("X", "FP32", 1, 3)], 1) == [_s("X", "FP32", [3])]
    with pytest.raises(ModelMismatch, match=r"element type tensor.bfloat16. is not one"):
        reconcile("outputs", [], [_t("Y", None, None, 3)], 8)
    with pytest.raises(ModelMismatch, match="scalar"):
        reconcile("outputs", [], [_t("Y", "FP32")], 8)


# --- the engine in this process ---------------------------------------------


def test_engine_fills_in_tensors_and_runs_batches(onnx_dir, eager):
    engine = OnnxEngine(_config("affine.onnx", cpu_threads=2), onnx_dir / "affine.onnx")
    engine.load()
    try:
        assert engine.config.inputs == [_s("INPUT0", "FP32", [16])]
        assert engine.config.outputs == [_s("OUTPUT0", "FP32", [16])]
        assert engine._session.get_session_options().intra_op_num_threads == 2
        for batch in (1, 7):
            x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            out = engine.run({"INPUT0": x}, engine.create_instance(0))["OUTPUT0"]
            want = eager["affine"](torch.from_numpy(x)).detach().numpy()
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        engine.unload()


def test_engine_refuses_a_model_with_a_fixed_batch(onnx_dir):
    engine = OnnxEngine(_config("fixed.onnx"), onnx_dir / "fixed.onnx")
    with pytest.raises(ModelMismatch, match="input 'X' has a fixed batch dimension of 4"):
        engine.load()


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="this onnxruntime has CUDA")
def test_engine_on_a_cuda_device_without_the_provider_logs_and_runs_on_the_cpu(onnx_dir, caplog):
    engine = OnnxEngine(_config("affine.onnx", device="cuda:0"), onnx_dir / "affine.onnx")
    with caplog.at_level(logging.WARNING, logger="aserve.engines.onnx"):
        engine.load()
    assert "install onnxruntime-gpu" in caplog.text
    out = engine.run({"INPUT0": np.ones((2, 16), np.float32)}, None)
    assert out["OUTPUT0"].shape == (2, 16)


# --- a real server -------------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_server(onnx_dir, model_dir):
    (onnx_dir / "affine.pt").write_bytes((model_dir / "affine.pt").read_bytes())
    models = [
        # No tensors listed: they come from the model file.
        _onnx_entry(
            "affine-onnx", "affine.onnx",
            batching={"max_batch_size": 32, "preferred_batch_sizes": [8, 16, 32]},
        ),
        _onnx_entry(
            "pair-onnx", "pair.onnx",
            [spec("A", "FP32", [8]), spec("B", "FP32", [8])],
            [spec("SUM", "FP32", [8]), spec("DOT", "FP32", [1])],
            instances=2,
        ),
        _onnx_entry("mlp-onnx", "mlp.onnx", batching={"max_batch_size": 16, "max_delay_ms": 5}),
        model_entry(
            "affine-torch", "affine.pt", [spec("INPUT0", "FP32", [16])],
            [spec("OUTPUT0", "FP32", [16])],
        ),
    ]  # fmt: skip
    srv = start_server(write_config(onnx_dir, {"models": models}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(onnx_server):
    c = httpclient.InferenceServerClient(onnx_server.url, network_timeout=30, concurrency=16)
    yield c
    c.close()


def _input(name, arr, module=httpclient):
    inp = module.InferInput(name, list(arr.shape), "FP32")
    inp.set_data_from_numpy(arr, binary_data=True)
    return inp


def test_metadata_comes_from_the_model_file(client, onnx_server):
    meta = client.get_model_metadata("affine-onnx")
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    assert "tensors from the model file" in onnx_server.log_text()


@pytest.mark.parametrize("batch", [1, 5, 32])
def test_infer_with_a_dynamic_batch_dimension(client, eager, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    result = client.infer("affine-onnx", [_input("INPUT0", x)])
    want = eager["affine"](torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), want, rtol=1e-5, atol=1e-5)


def test_two_inputs_two_outputs(client, eager):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((3, 8)).astype(np.float32)
    result = client.infer("pair-onnx", [_input("A", a), _input("B", b)])
    want_sum, want_dot = (
        t.detach().numpy() for t in eager["pair"](torch.tensor(a), torch.tensor(b))
    )
    np.testing.assert_allclose(result.as_numpy("SUM"), want_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("DOT"), want_dot, rtol=1e-5, atol=1e-5)
    # One output asked for, as JSON: only that one comes back.
    only = client.infer(
        "pair-onnx", [_input("A", a), _input("B", b)],
        outputs=[httpclient.InferRequestedOutput("DOT", binary_data=False)],
    )  # fmt: skip
    assert [o["name"] for o in only.get_response()["outputs"]] == ["DOT"]
    np.testing.assert_allclose(only.as_numpy("DOT"), want_dot, rtol=1e-5, atol=1e-5)


def test_wrong_datatype_is_refused_with_400(client):
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float64))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("affine-onnx", [inp])
    assert exc.value.status() == "400"


async def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(onnx_server, eager):
    import tritonclient.http.aio as aioclient

    rng = np.random.default_rng(21)
    xs = [rng.standard_normal((1 + i % 3, 64)).astype(np.float32) for i in range(64)]
    client = aioclient.InferenceServerClient(onnx_server.url, conn_limit=64)
    try:
        before = (await client.get_inference_statistics("mlp-onnx"))["model_stats"][0]
        results = await asyncio.gather(
            *(client.infer("mlp-onnx", [_input("X", x, aioclient)]) for x in xs)
        )
        after = (await client.get_inference_statistics("mlp-onnx"))["model_stats"][0]
    finally:
        await client.close()
    for x, result in zip(xs, results, strict=True):
        want = eager["mlp"](torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(result.as_numpy("Y"), want, rtol=1e-4, atol=1e-4)
    requests = (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    )
    batches = after["execution_count"] - before["execution_count"]
    assert requests == len(xs)
    # Fewer batches than requests: requests that arrived together shared a batch.
    assert batches < requests


def test_onnx_and_torch_engines_agree_on_the_same_model(client):
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    onnx_out, torch_out = (
        client.infer(m, [_input("INPUT0", x)]).as_numpy("OUTPUT0")
        for m in ("affine-onnx", "affine-torch")
    )
    np.testing.assert_allclose(onnx_out, torch_out, rtol=1e-5, atol=1e-5)


def test_a_config_that_contradicts_the_model_stops_the_server_with_the_reason(onnx_dir):
    entry = _onnx_entry("bad", "affine.onnx", [spec("INPUT0", "FP16", [16])])
    path = write_config(onnx_dir, {"models": [entry]}, name="bad.json")
    proc = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "input 'INPUT0': the config declares FP16, the model's is FP32" in proc.stderr
