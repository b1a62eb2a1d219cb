"""CUDA executors on a real GPU: the torch engine on several streams, CUDA graphs,
onnxruntime's CUDA provider. Skipped, with the reason, where there is no GPU.

On a CPU-only machine the pure pieces of CUDA graph support still run here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aserve.engines.cuda_graphs import capture_sizes

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = f"needs a CUDA GPU; this torch ({torch.__version__}) sees none"


def test_graphs_are_captured_for_preferred_sizes_and_the_max_largest_first():
    assert capture_sizes([8, 16, 32], 32) == [32, 16, 8]
    assert capture_sizes([], 4) == [4]
    assert capture_sizes([2, 2], 8) == [8, 2]


def _affine(n: int = 16):
    return {"name": "INPUT0", "datatype": "FP32", "shape": [n]}


@pytest.fixture(scope="module")
def cuda_server(model_dir):
    from conftest import model_entry, start_server, write_config

    batching = {"max_batch_size": 32, "preferred_batch_sizes": [8, 16]}
    out = {**_affine(), "name": "OUTPUT0"}
    models = [
        model_entry("affine-cuda", "affine.pt", [_affine()], [out], device="cuda:0",
                    instances=2, batching=batching),
        model_entry("affine-graphs", "affine.pt", [_affine()], [out], device="cuda:0",
                    instances=2, cuda_graphs=True, batching=batching),
    ]  # fmt: skip
    srv = start_server(write_config(model_dir, {"models": models}, name="cuda.json"))
    yield srv
    srv.stop()


def _infer(srv, model: str, x: np.ndarray) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(srv.url)
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(model, [inp]).as_numpy("OUTPUT0")
    finally:
        client.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("batch", [1, 3, 8, 16, 32])  # 8, 16, 32 replay graphs; 1, 3 run eagerly
@pytest.mark.parametrize("model", ["affine-cuda", "affine-graphs"])
def test_cuda_instances_answer_like_the_cpu(cuda_server, eager_models, model, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(_infer(cuda_server, model, x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_graphs_were_captured_per_instance(cuda_server):
    log = cuda_server.log_text()
    for index in (0, 1):
        assert (
            f"model affine-graphs instance {index}: captured CUDA graphs for batch sizes 8, 16, 32"
            in log
        )
    assert "capture failed" not in log


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_concurrent_batches_on_two_streams_stay_apart(cuda_server, eager_models):
    import asyncio

    import tritonclient.http.aio as aioclient

    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((1 + i % 8, 16)).astype(np.float32) for i in range(128)]

    async def run(model):
        client = aioclient.InferenceServerClient(cuda_server.url, conn_limit=64)
        try:

            async def one(x):
                inp = aioclient.InferInput("INPUT0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                return (await client.infer(model, [inp])).as_numpy("OUTPUT0")

            return await asyncio.gather(*(one(x) for x in xs))
        finally:
            await client.close()

    for model in ("affine-cuda", "affine-graphs"):
        for x, got in zip(xs, asyncio.run(run(model)), strict=True):
            want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.skipif(not _ort_has_cuda(), reason="this onnxruntime has no CUDAExecutionProvider")
def test_onnx_engine_on_the_cuda_provider(tmp_path, eager_models):
    pytest.importorskip("onnxscript", reason="exporting test models needs onnxscript")
    from models import Affine
    from onnx_models import export

    from aserve.config import parse_config
    from aserve.engines.onnx_engine import OnnxEngine

    export(Affine().eval(), (torch.randn(2, 16),), tmp_path / "a.onnx", ["INPUT0"], ["OUTPUT0"])
    cfg = parse_config({"models": [{"name": "a", "engine": "onnx", "path": "a.onnx",
                                    "device": "cuda:0"}]}).models[0]  # fmt: skip
    engine = OnnxEngine(cfg, tmp_path / "a.onnx")
    engine.load()
    assert engine._session.get_providers()[0] == "CUDAExecutionProvider"
    x = np.random.default_rng(2).standard_normal((6, 16)).astype(np.float32)
    got = engine.run({"INPUT0": x}, None)["OUTPUT0"]
    want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_unload_gives_the_gpu_memory_back(model_dir):
    import gc

    from aserve.config import parse_config
    from aserve.engines.torch_engine import TorchEngine

    entry = {"name": "a", "engine": "torch", "path": "affine.pt", "device": "cuda:0",
             "cuda_graphs": True, "inputs": [_affine()], "outputs": [{**_affine(), "name": "OUTPUT0"}],
             "batching": {"max_batch_size": 8, "preferred_batch_sizes": [4]}}  # fmt: skip
    cfg = parse_config({"models": [entry]}).models[0]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    engine = TorchEngine(cfg, model_dir / "affine.pt")
    engine.load()
    instance = engine.create_instance(0)
    assert sorted(instance.graphs) == [4, 8]
    out = engine.run({"INPUT0": np.ones((4, 16), np.float32)}, instance)["OUTPUT0"]
    assert out.shape == (4, 16)
    assert torch.cuda.memory_allocated(0) > base
    del instance
    engine.unload()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) <= base


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_gpu_mem_limit_refuses_memory_past_the_cap():
    # In its own process: the cap holds for the whole process that sets it.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from aserve.config import GpuConfig\n"
        "from aserve.engines.gpu_memory import apply_memory_limit\n"
        "apply_memory_limit(torch.cuda, GpuConfig(mem_limit_mib=256), [0])\n"
        "small = torch.empty(64 * 2**20 // 4, device='cuda:0')\n"
        "try:\n"
        "    torch.empty(512 * 2**20 // 4, device='cuda:0')\n"
        "    print('ALLOCATED')\n"
        "except torch.cuda.OutOfMemoryError:\n"
        "    print('REFUSED')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "REFUSED", done.stderr
