"""``aserve serve FILE``: real servers started on a model file with no config.

Each format is served by ``python -m aserve serve ...`` on free ports and
answers a real request (aiohttp, tritonclient.grpc) with what the model
computes in this process. Bad flags exit with status 2 naming the flag.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import HANDLERS, ServerProcess, start_server, write_config

pytestmark = pytest.mark.timeout(180)


def serve(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    return start_server(None, extra_env=env, argv=["serve", *args, "--port", "0"])


def aserve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )  # fmt: skip


async def infer(base: str, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    body = {
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, a in inputs.items()
        ]
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/models/{model}/infer", json=body) as r:
            doc = await r.json()
            assert r.status == 200, doc
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in doc["outputs"]}


async def metadata(base: str, model: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v2/models/{model}") as r:
            assert r.status == 200
            return await r.json()


def tensors(meta: dict[str, Any], kind: str) -> list[tuple[str, str, list[int]]]:
    return [(t["name"], t["datatype"], t["shape"]) for t in meta[kind]]


@pytest.fixture(scope="module")
def onnx_affine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models import Affine
    from onnx_models import export

    path = tmp_path_factory.mktemp("onnx") / "affine.onnx"
    return export(Affine(), (torch.randn(2, 16),), path, ["INPUT0"], ["OUTPUT0"])


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import lm_models

    return lm_models.tiny_model("gpt2", tmp_path_factory.mktemp("lms"))


async def test_torchscript_with_tensor_flags(model_dir: Path, eager_models: dict) -> None:
    srv = serve(
        str(model_dir / "affine.pt"), "--input", "INPUT0:FP32:16", "--output", "OUTPUT0:fp32:16",
        "--grpc-port", "0", "--max-batch-size", "8", "--preferred-batch-sizes", "4,8",
        "--instances", "2",
    )  # fmt: skip
    try:
        x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
        want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
        out = await infer(srv.base, "affine", {"INPUT0": x})
        np.testing.assert_allclose(out["OUTPUT0"], want, rtol=1e-5, atol=1e-5)
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        try:
            inp = grpcclient.InferInput("INPUT0", [3, 16], "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("affine", [inp]).as_numpy("OUTPUT0")
            config = client.get_model_config("affine", as_json=True)["config"]
        finally:
            client.close()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert int(config["max_batch_size"]) == 8
        assert [int(s) for s in config["dynamic_batching"]["preferred_batch_size"]] == [4, 8]
    finally:
        assert srv.stop() == 0


async def test_exported_program_tensors_from_the_file(model_dir: Path, eager_models: dict) -> None:
    srv = serve(str(model_dir / "pair.pt2"), "--no-grpc", "--name", "duo")
    try:
        meta = await metadata(srv.base, "duo")
        assert tensors(meta, "inputs") == [("a", "FP32", [-1, 8]), ("b", "FP32", [-1, 8])]
        assert tensors(meta, "outputs") == [("SUM", "FP32", [-1, 8]), ("DOT", "FP32", [-1, 1])]
        rng = np.random.default_rng(1)
        a, b = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
        want = eager_models["pair"](torch.from_numpy(a), torch.from_numpy(b))
        out = await infer(srv.base, "duo", {"a": a, "b": b})
        for name in ("SUM", "DOT"):
            np.testing.assert_allclose(out[name], want[name].numpy(), rtol=1e-5, atol=1e-5)
    finally:
        srv.stop()


async def test_onnx_tensors_from_the_file(onnx_affine: Path, eager_models: dict) -> None:
    srv = serve(str(onnx_affine), "--no-grpc")
    try:
        meta = await metadata(srv.base, "affine")
        assert tensors(meta, "inputs") == [("INPUT0", "FP32", [-1, 16])]
        assert tensors(meta, "outputs") == [("OUTPUT0", "FP32", [-1, 16])]
        x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
        want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
        out = await infer(srv.base, "affine", {"INPUT0": x})
        np.testing.assert_allclose(out["OUTPUT0"], want, rtol=1e-4, atol=1e-4)
    finally:
        srv.stop()


async def test_decoder_folder(tiny_gpt2: Path) -> None:
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine
    from aserve.types.generation import SamplingParams

    engine = DecoderEngine(tiny_gpt2, GenerationConfig(max_num_seqs=1, max_model_len=64))
    engine.load()
    seq = engine.new_sequence("r", "Hello", SamplingParams(temperature=0, max_tokens=8))
    while not seq.finished:
        engine.step([seq] if not seq.output_ids else [], [seq] if seq.output_ids else [])
    want = engine.tokenizer.decode(seq.output_ids)

    srv = serve(str(tiny_gpt2), "--no-grpc", "--max-batch-size", "4", "--timeout-ms", "60000")
    try:
        body = {"text_input": "Hello", "parameters": {"temperature": 0}, "max_tokens": 8}
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.base + "/v2/models/gpt2/generate", json=body) as r:
                doc = await r.json()
                assert r.status == 200, doc
        assert doc["text_output"] == want
    finally:
        srv.stop()


async def test_handler_class(tmp_path: Path) -> None:
    shutil.copy(HANDLERS / "count_elements.py", tmp_path / "count_elements.py")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    srv = serve(
        "count_elements:CountElements", "--no-grpc",
        "--input", "ITEMS:BYTES:-1", "--output", "COUNT:INT64:1", "--output", "TOTAL:INT64:1",
        env=env,
    )  # fmt: skip
    try:
        body = {"inputs": [{"name": "ITEMS", "datatype": "BYTES", "shape": [1, 3],
                            "data": ["a", "bc", "def"]}]}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.base + "/v2/models/count_elements/infer", json=body) as r:
                doc = await r.json()
                assert r.status == 200, doc
        got = {o["name"]: o["data"] for o in doc["outputs"]}
        assert got == {"COUNT": [3], "TOTAL": [6]}
    finally:
        srv.stop()


async def test_printed_config_serves_the_same_model(
    onnx_affine: Path, tmp_path: Path, eager_models: dict
) -> None:
    done = aserve("serve", str(onnx_affine), "--grpc-port", "0", "--max-batch-size", "16",
                  "--max-concurrency", "64", "--print-config")  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["models"][0]["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}]
    assert printed["limits"] == {"max_concurrency": 64}
    # Saved elsewhere: its paths are absolute.
    srv = start_server(write_config(tmp_path, printed))
    try:
        assert srv.grpc_port is not None
        x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
        want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
        out = await infer(srv.base, "affine", {"INPUT0": x})
        np.testing.assert_allclose(out["OUTPUT0"], want, rtol=1e-4, atol=1e-4)
        meta = await metadata(srv.base, "affine")
        assert tensors(meta, "inputs") == [("INPUT0", "FP32", [-1, 16])]
    finally:
        srv.stop()


def test_api_key_file_is_required_by_the_server(model_dir: Path, tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    keys = tmp_path / "keys.txt"
    keys.write_text("# one a line\nsecret-key\n")
    srv = serve(
        str(model_dir / "pair.pt2"), "--no-grpc", "--api-key-file", str(keys),
        "--max-connections", "8",
    )  # fmt: skip
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(srv.base + "/v2/models/pair", timeout=10)
        assert err.value.code == 401
        req = urllib.request.Request(
            srv.base + "/v2/models/pair", headers={"Authorization": "Bearer secret-key"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    finally:
        srv.stop()


def test_admin_key_file_opens_the_repository_api_to_its_keys_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    import urllib.error
    import urllib.request

    (tmp_path / "keys.txt").write_text("inference-key\n")
    (tmp_path / "admin.txt").write_text("admin-key\n")
    srv = serve(
        str(model_dir / "pair.pt2"), "--no-grpc", "--api-key-file", str(tmp_path / "keys.txt"),
        "--admin-key-file", str(tmp_path / "admin.txt"),
    )  # fmt: skip

    def index(key: str) -> int:
        req = urllib.request.Request(
            srv.base + "/v2/repository/index", data=b"{}",
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert index("inference-key") == 403
        assert index("admin-key") == 200
    finally:
        srv.stop()


BAD = [
    (["{pt}", "--input", "INPUT0", "--output", "OUTPUT0:FP32:16"],
     "--input INPUT0: expected NAME:DTYPE:SHAPE"),
    (["{pt}", "--input", "INPUT0:FP32:16x", "--output", "OUTPUT0:FP32:16"],
     "--input INPUT0:FP32:16x: the shape '16x' is not comma-separated integers"),
    (["{pt}", "--input", "INPUT0:FLOAT:16", "--output", "OUTPUT0:FP32:16"],
     "--input INPUT0:FLOAT:16: Input should be 'BOOL'"),
    (["{pt}", "--input", "INPUT0:FP32:0", "--output", "OUTPUT0:FP32:16"],
     "--input INPUT0:FP32:0: dimension 0 must be >= 1"),
    (["{pt}", "--output", "OUTPUT0:FP32:16"], "--input: required with engine 'torch'"),
    (["{pt2}", "--max-batch-size", "0"], "--max-batch-size: must be >= 1 (got 0)"),
    (["{pt2}", "--preferred-batch-sizes", "8,64"],
     "--preferred-batch-sizes: 64 must be between 1 and max_batch_size (32)"),
    (["{pt2}", "--preferred-batch-sizes", "8;16"], "--preferred-batch-sizes 8;16: expected"),
    (["{pt2}", "--max-batch-size", "100"],
     "the program's batch dimension goes up to 64, below max_batch_size (100)"),
    (["{pt2}", "--device", "gpu"], "--device: 'gpu' is not a device"),
    (["{pt2}", "--instances", "0"], "--instances: must be >= 1 (got 0)"),
    (["{pt2}", "--port", "70000"], "--port: must be <= 65535"),
    (["{pt2}", "--max-concurrency", "0"], "--max-concurrency: must be >= 1"),
    (["{pt2}", "--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys: no such"),
    (["{pt2}", "--admin-key-file", "/nonexistent/keys"], "--admin-key-file /nonexistent/keys: no such"),
    (["{pt2}", "--port", "x"], "--port: invalid int value: 'x'"),
    (["{pt2}", "--no-grpc", "--grpc-port", "1"], "not allowed with argument"),
    (["{lm}", "--max-delay-ms", "5"], "--max-delay-ms: not for engine 'decoder'"),
    (["{lm}", "--executor", "process"], "--executor: 'process' is for engines"),
    (["{lm}", "--max-model-len", "4096"], "--max-model-len 4096: exceeds the model's context length (128 positions)"),
    (["{pt2}", "--max-model-len", "64"], "--max-model-len: only for engine 'decoder'"),
    (["{dir}"], "a folder to serve is a decoder model (no config.json in it)"),
    (["{dir}/missing.pt"], "missing.pt: no such file"),
    (["{dir}/model.bin"], "unknown kind of model file '.bin'"),
    (["nosuchmodule:Handler", "--input", "X:FP32:1", "--output", "Y:FP32:1"],
     "nosuchmodule:Handler: cannot import module 'nosuchmodule'"),
    (["{dir}/model.aserve"], "model.aserve: cannot read archive: No such file or directory"),
    (["{dir}/model.plan"], "the tensorrt engine needs"),  # a GPU and TensorRT (gpu_check.sh)
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_command_lines_exit_2_naming_the_flag(
    args: list[str], message: str, model_dir: Path, tiny_gpt2: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from aserve.cli import main

    # In this process (the command line is all that differs): a torch import each is slow.
    monkeypatch.chdir(tmp_path)
    for name in ("model.bin", "model.plan"):
        (tmp_path / name).write_bytes(b"x")
    where = {"pt": model_dir / "affine.pt", "pt2": model_dir / "pair.pt2", "lm": tiny_gpt2,
             "dir": tmp_path}  # fmt: skip
    argv = ["serve", *(a.format(**where) for a in args), "--print-config"]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert message in err, err
    assert "Traceback" not in err and out == ""


def test_every_flag_lands_in_its_config_key(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """What GRPS users set on the command line, each flag in the key the docs name
    (docs/guide/models.md, "One file, no config")."""
    from aserve.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keys.txt").write_text("k\n")
    (tmp_path / "admin.txt").write_text("a\n")
    rc = main([
        "serve", str(model_dir / "affine.pt"), "--input", "INPUT0:FP32:16",
        "--output", "OUTPUT0:FP32:16", "--host", "0.0.0.0", "--port", "9000",
        "--grpc-port", "9001", "--name", "lin", "--device", "cpu", "--instances", "2",
        "--executor", "process", "--cpu-threads", "2", "--max-batch-size", "16",
        "--max-delay-ms", "3", "--preferred-batch-sizes", "4,8", "--max-queue-size", "100",
        "--timeout-ms", "2500", "--max-connections", "50", "--max-concurrency", "40",
        "--gpu-mem-limit-mib", "1000", "--empty-cache-interval-s", "30",
        "--api-key-file", "keys.txt", "--admin-key-file", "admin.txt", "--print-config",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    printed = json.loads(out)
    model = printed.pop("models")[0]
    assert printed == {
        "http": {"host": "0.0.0.0", "port": 9000},
        "grpc": {"host": "0.0.0.0", "port": 9001},
        "limits": {"max_connections": 50, "max_concurrency": 40},
        "gpu": {"mem_limit_mib": 1000, "empty_cache_interval_s": 30.0},
        "auth": {
            "api_keys_file": str(tmp_path / "keys.txt"),
            "admin_keys_file": str(tmp_path / "admin.txt"),
        },
    }
    assert model == {
        "name": "lin", "engine": "torch", "path": str(model_dir / "affine.pt"),
        "device": "cpu", "instances": 2, "executor": "process", "cpu_threads": 2,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
        "batching": {"max_batch_size": 16, "max_delay_ms": 3.0, "preferred_batch_sizes": [4, 8],
                     "max_queue_size": 100, "timeout_ms": 2500.0},
    }  # fmt: skip


def test_the_config_flag_and_no_arguments_still_work(model_dir: Path) -> None:
    done = aserve("serve", str(model_dir / "affine.pt"), "--input", "INPUT0:FP32:16")
    assert done.returncode == 2 and "--output: required with engine 'torch'" in done.stderr
    done = aserve("--help")
    assert done.returncode == 0
    assert "--config" in done.stdout and "serve" in done.stdout and "ps" in done.stdout
    done = aserve("--config", str(model_dir / "missing.json"))
    assert done.returncode == 2 and "cannot read config" in done.stderr


def test_an_archive_is_served_with_the_flags_on_top_of_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from aserve.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["new", "demo"]) == 0
    assert main(["archive", "demo", "-o", "demo.aserve", "--skip-tests"]) == 0
    capsys.readouterr()
    rc = main(["serve", "demo.aserve", "--port", "9000", "--no-grpc", "--device", "cpu",
               "--max-batch-size", "4", "--print-config"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    printed = json.loads(out)
    assert printed["http"]["port"] == 9000 and "grpc" not in printed
    assert printed["models"][0]["name"] == "demo"
    assert printed["models"][0]["batching"]["max_batch_size"] == 4
    # The archive was verified, not extracted: its model files resolve where serving puts it.
    assert str(tmp_path / "cache" / "archives") in printed["models"][0]["root"]
