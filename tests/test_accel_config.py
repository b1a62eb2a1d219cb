"""Config rules of the accelerated engines: onnx, tensorrt, precision, cuda_graphs,
and the check, at config load, that an engine's packages (and GPU) are there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aserve.config import ConfigError, parse_config
from aserve.engines.checks import check_model_files
from aserve.engines.requirements import engine_problem

X = [{"name": "X", "datatype": "FP32", "shape": [4]}]


def _model(**fields):
    return {"name": "m", "path": "m.bin", "inputs": X, "outputs": X, **fields}


def _error(**fields) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config({"models": [_model(**fields)]})
    return str(exc.value)


def test_an_onnx_model_may_leave_its_tensors_to_the_model_file():
    cfg = parse_config({"models": [{"name": "m", "engine": "onnx", "path": "m.onnx"}]})
    assert cfg.models[0].inputs == [] and cfg.models[0].outputs == []


def test_a_torch_model_must_still_list_its_tensors():
    with pytest.raises(ConfigError, match=r"models.0..inputs: required with engine 'torch'"):
        parse_config({"models": [{"name": "m", "engine": "torch", "path": "m.pt", "outputs": X}]})


def test_defaults():
    m = parse_config({"models": [_model(engine="torch")]}).models[0]
    assert m.precision == "fp32" and m.cuda_graphs is False


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "torch", "precision": "fp16"}, "precision: only for engine 'tensorrt'"),
        ({"engine": "onnx", "precision": "fp16"}, "precision: only for engine 'tensorrt'"),
        ({"engine": "tensorrt", "precision": "int8", "device": "cuda"}, "precision"),
        ({"engine": "tensorrt"}, "device: the tensorrt engine runs on a GPU"),
        (
            {"engine": "tensorrt", "device": "cuda", "inputs": [{**X[0], "shape": [-1]}]},
            "'X' has shape [-1]: the tensorrt engine needs fixed dimensions",
        ),
        ({"engine": "torch", "cuda_graphs": True}, "cuda_graphs: only for engine 'torch' on a CUDA"),
        ({"engine": "onnx", "device": "cuda", "cuda_graphs": True}, "engine 'onnx' on 'cuda'"),
        (
            {"engine": "torch", "device": "cuda:0", "cuda_graphs": True,
             "inputs": [{**X[0], "shape": [-1]}]},
            "cuda_graphs: needs fixed input shapes; X has a variable dimension",
        ),
    ],
)  # fmt: skip
def test_accelerator_fields_are_checked(fields, message):
    assert message in _error(**fields)


def test_valid_accelerator_configs():
    ok = [
        _model(engine="tensorrt", device="cuda:1", precision="fp16"),
        _model(engine="torch", device="cuda", cuda_graphs=True, name="t"),
        _model(engine="onnx", device="cuda:0", cpu_threads=4, instances=2, name="o"),
    ]
    assert len(parse_config({"models": ok}).models) == 3


def _finder(present: set[str]):
    return lambda name: object() if name in present else None


def test_engine_problem_names_what_is_missing():
    gpus = lambda: (1, None)  # noqa: E731
    find = _finder(set())
    assert "pip install 'aserve[onnx]'" in engine_problem("onnx", "cpu", find, gpus)
    assert engine_problem("onnx", "cpu", _finder({"onnxruntime"}), gpus) is None
    assert engine_problem("torch", "cuda", find, gpus) is None
    msg = engine_problem("tensorrt", "cuda", find, gpus)
    assert "needs TensorRT, which is not installed" in msg
    msg = engine_problem("tensorrt", "cuda", _finder({"tensorrt"}), gpus)
    assert "needs cuda-python" in msg
    both = _finder({"tensorrt", "cuda.bindings"})
    assert engine_problem("tensorrt", "cuda:0", both, gpus) is None
    assert "only 1 CUDA device(s)" in engine_problem("tensorrt", "cuda:1", both, gpus)
    no_gpu = lambda: (0, "the CUDA runtime sees no device")  # noqa: E731
    assert engine_problem("tensorrt", "cuda", both, no_gpu) == (
        "the tensorrt engine needs an NVIDIA GPU: the CUDA runtime sees no device"
    )
    older = _finder({"tensorrt", "cuda.cudart"})  # cuda-python before 12.6
    assert engine_problem("tensorrt", "cuda", older, gpus) is None


def test_a_finder_that_raises_counts_as_missing():
    def find(name):
        raise ModuleNotFoundError(name)

    assert "not installed" in engine_problem("onnx", "cpu", find)


def test_check_model_files_reports_the_engine(tmp_path: Path, monkeypatch):
    (tmp_path / "m.bin").write_bytes(b"")
    cfg = parse_config({"models": [_model(engine="onnx")]})
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"models\[0\].engine: the onnx engine needs onnxruntime"):
        check_model_files(cfg, tmp_path)


def test_cli_refuses_tensorrt_without_it_at_config_load(tmp_path: Path):
    problem = engine_problem("tensorrt", "cuda:0")
    if problem is None:
        pytest.skip("TensorRT and a GPU are here: nothing to refuse")
    (tmp_path / "m.plan").write_bytes(b"")
    config = {"models": [_model(engine="tensorrt", device="cuda:0", path="m.plan")]}
    (tmp_path / "c.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(tmp_path / "c.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"models[0].engine: {problem}" in proc.stderr
    assert "Traceback" not in proc.stderr
