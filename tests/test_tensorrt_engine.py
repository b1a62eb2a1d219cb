"""The TensorRT engine: everything that runs without TensorRT or a GPU (profiles,
cache keys and the build flow against a stand-in ``tensorrt`` module, the fp16
conversion, buffer sizes, the errors without TensorRT), then GPU tests that
are skipped, with the reason, where TensorRT or a GPU is missing."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from aserve.config import TensorSpec, parse_config
from aserve.engines import tensorrt_build as tb
from aserve.engines.requirements import engine_problem
from aserve.engines.tensorrt_engine import TRT_DATATYPES, TensorRTEngine, buffer_bytes
from aserve.types.tensors import DATATYPES

X16 = TensorSpec(name="X", datatype="FP32", shape=[16])


def test_profile_covers_batch_one_to_max_tuned_for_the_largest_preferred_size():
    profile = tb.optimization_profile([X16], 32, [4, 8])
    assert profile == {"X": ((1, 16), (8, 16), (32, 16))}
    assert tb.optimization_profile([X16], 32, [])["X"][1] == (32, 16)


def test_profile_refuses_variable_dimensions():
    with pytest.raises(ValueError, match=r"build the engine with trtexec and serve the .plan"):
        tb.optimization_profile([TensorSpec(name="L", datatype="INT64", shape=[-1])], 8, [])


def test_cache_key_changes_with_everything_that_changes_the_engine():
    profile = tb.optimization_profile([X16], 32, [8])
    base = ("digest", "10.13.0", "NVIDIA H200 sm90", "fp32", profile, 2)
    key = tb.cache_key(*base)
    assert key == tb.cache_key(*base)  # stable
    variants = [
        ("digest2", *base[1:]),
        (base[0], "11.4.0", *base[2:]),
        (*base[:2], "NVIDIA H100 sm90", *base[3:]),
        (*base[:3], "fp16", *base[4:]),
        (*base[:4], tb.optimization_profile([X16], 16, [8]), base[5]),
        (*base[:5], 3),
    ]
    keys = {tb.cache_key(*v) for v in variants}
    assert key not in keys and len(keys) == len(variants)


def test_model_digest_covers_the_external_weights(tmp_path: Path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"graph")
    alone = tb.model_digest(model)
    (tmp_path / "m.onnx.data").write_bytes(b"weights")
    with_data = tb.model_digest(model)
    (tmp_path / "m.onnx.data").write_bytes(b"weights, changed")
    assert len({alone, with_data, tb.model_digest(model)}) == 3


def test_cache_dir_follows_aserve_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    assert tb.cache_dir() == tmp_path / "tensorrt"
    path = tb.cached_engine_path(Path("/models/resnet.onnx"), "ab" * 32)
    assert path == tmp_path / "tensorrt" / f"resnet-{'ab' * 12}.engine"


class FakeTensorRT:
    """Just enough of the ``tensorrt`` module for the build flow; records what it was asked."""

    def __init__(self, has_fp16_flag: bool, on_parse=None) -> None:
        self.__version__ = "11.4.0" if not has_fp16_flag else "10.13.0"
        self.calls: list[tuple] = []
        self.builds = 0
        self.Logger = type("Logger", (), {"WARNING": 1, "__init__": lambda self, level: None})
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
        self.BuilderFlag = types.SimpleNamespace(**({"FP16": "fp16"} if has_fp16_flag else {}))
        fake = self

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls.append(("set_shape", name, lo, opt, hi))

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("pool", pool, size))

            def set_flag(self, flag):
                fake.calls.append(("flag", flag))

            def add_optimization_profile(self, profile):
                fake.calls.append(("profile",))

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                return object()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                fake.builds += 1
                return b"ENGINE"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                fake.calls.append(("parse", path))
                if on_parse is not None:
                    on_parse(Path(path))
                return True

        self.Builder, self.OnnxParser = Builder, OnnxParser


@pytest.fixture(scope="module")
def affine_onnx(tmp_path_factory) -> Path:
    pytest.importorskip("onnxscript", reason="exporting test models needs onnxscript (dev extra)")
    import torch
    from models import Affine
    from onnx_models import export

    folder = tmp_path_factory.mktemp("trt")
    return export(Affine().eval(), (torch.randn(2, 16),), folder / "affine.onnx", ["X"], ["Y"])


def test_build_uses_the_fp16_flag_where_tensorrt_has_it_and_caches(affine_onnx, tmp_path: Path):
    trt = FakeTensorRT(has_fp16_flag=True)
    args = (trt, affine_onnx, "GPU sm90", [X16], 32, [8], "fp16", 2, tmp_path)
    data, path, built = tb.load_or_build(*args)
    assert (data, built) == (b"ENGINE", True) and path.read_bytes() == b"ENGINE"
    assert ("flag", "fp16") in trt.calls
    assert ("parse", str(affine_onnx)) in trt.calls
    assert trt.calls.count(("profile",)) == 2  # one per instance
    assert ("set_shape", "X", (1, 16), (8, 16), (32, 16)) in trt.calls
    # The second load finds the cached engine and builds nothing.
    assert tb.load_or_build(*args) == (b"ENGINE", path, False)
    assert trt.builds == 1
    # Another GPU (or TensorRT, or precision) is another cache entry.
    assert tb.load_or_build(trt, affine_onnx, "GPU sm80", *args[3:])[2] is True


def test_build_converts_to_fp16_where_tensorrt_has_no_flag(affine_onnx, tmp_path: Path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxconverter_common")
    import onnx
    import torch
    from models import Affine

    seen = {}

    def on_parse(path: Path):  # the converted file exists while TensorRT parses it
        model = onnx.load(str(path))
        seen["types"] = {t.data_type for t in model.graph.initializer}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        seen["io"] = [a.type for a in (*session.get_inputs(), *session.get_outputs())]
        x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
        seen["out"], seen["x"] = session.run(None, {"X": x})[0], x

    trt = FakeTensorRT(has_fp16_flag=False, on_parse=on_parse)
    tb.load_or_build(trt, affine_onnx, "GPU", [X16], 8, [], "fp16", 1, tmp_path)
    parsed = next(c[1] for c in trt.calls if c[0] == "parse")
    assert parsed != str(affine_onnx) and not Path(parsed).exists()  # a temporary copy
    assert not any(c[0] == "flag" for c in trt.calls)
    assert seen["types"] == {onnx.TensorProto.FLOAT16}
    assert seen["io"] == ["tensor(float)", "tensor(float)"]  # fp32 in and out
    want = Affine().eval()(torch.from_numpy(seen["x"])).detach().numpy()
    np.testing.assert_allclose(seen["out"], want, rtol=2e-2, atol=2e-2)


def test_fp32_builds_set_no_precision_flag(affine_onnx, tmp_path: Path):
    trt = FakeTensorRT(has_fp16_flag=True)
    tb.load_or_build(trt, affine_onnx, "GPU", [X16], 8, [], "fp32", 1, tmp_path)
    assert not any(c[0] == "flag" for c in trt.calls)


def test_datatype_table_and_buffer_sizes():
    assert set(TRT_DATATYPES.values()) <= set(DATATYPES)
    assert TRT_DATATYPES["FLOAT"] == "FP32" and TRT_DATATYPES["HALF"] == "FP16"
    assert buffer_bytes("FP32", [16], 32) == 32 * 16 * 4
    assert buffer_bytes("INT64", [2, 3], 4) == 4 * 6 * 8
    assert buffer_bytes("BOOL", [], 8) == 8
    with pytest.raises(ValueError, match="fixed dimensions"):
        buffer_bytes("FP32", [-1], 8)


def _trt_config(path: str):
    x = [{"name": "X", "datatype": "FP32", "shape": [16]}]
    entry = {"name": "m", "engine": "tensorrt", "path": path, "device": "cuda:0",
             "inputs": x, "outputs": [{**x[0], "name": "Y"}]}  # fmt: skip
    return parse_config({"models": [entry]}).models[0]


def test_loading_without_tensorrt_says_what_is_missing(tmp_path: Path):
    problem = engine_problem("tensorrt", "cuda:0")
    if problem is None:
        pytest.skip("TensorRT and a GPU are here")
    (tmp_path / "m.plan").write_bytes(b"")
    engine = TensorRTEngine(_trt_config("m.plan"), tmp_path / "m.plan")
    with pytest.raises(RuntimeError) as exc:
        engine.load()
    assert str(exc.value) == problem


# --- on a GPU with TensorRT --------------------------------------------------------

_TRT_PROBLEM = engine_problem("tensorrt", "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(_TRT_PROBLEM is not None, reason=f"needs TensorRT and a GPU: {_TRT_PROBLEM}")
def test_tensorrt_serves_an_onnx_model_on_two_streams_and_reuses_its_cache(affine_onnx, tmp_path):
    import torch
    import tritonclient.http as httpclient
    from conftest import start_server, write_config
    from models import Affine

    x16 = [{"name": "X", "datatype": "FP32", "shape": [16]}]
    model = {
        "name": "affine-trt", "engine": "tensorrt", "path": str(affine_onnx), "device": "cuda:0",
        "instances": 2, "inputs": x16, "outputs": [{**x16[0], "name": "Y"}],
        "batching": {"max_batch_size": 16, "preferred_batch_sizes": [8]},
    }  # fmt: skip
    env = {"ASERVE_CACHE_DIR": str(tmp_path / "cache")}
    for attempt in ("built", "cached"):
        srv = start_server(write_config(tmp_path, {"models": [model]}), extra_env=env)
        try:
            assert f"{attempt} TensorRT engine" in srv.log_text()
            client = httpclient.InferenceServerClient(srv.url)
            x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
            inp = httpclient.InferInput("X", [5, 16], "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("affine-trt", [inp]).as_numpy("Y")
            want = Affine().eval()(torch.from_numpy(x)).detach().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
            client.close()
        finally:
            srv.stop()


# --- the engine's data path, against stand-ins for TensorRT and the CUDA runtime ---------


class _Memory:
    """Host-side stand-ins for device and pinned buffers: bytes found by their 'pointer'."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, np.ndarray] = {}
        self.freed: list[int] = []

    def alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        data = np.zeros(max(nbytes, 1), np.uint8)
        ptr = 0x1000 + 0x100000 * len(self.by_ptr)
        self.by_ptr[ptr] = data
        return ptr, data


def _fake_cuda(monkeypatch, memory: _Memory, log: list):
    from aserve.engines import cuda_rt

    class Stream:
        def __init__(self):
            self.handle, self.ptr = object(), 77

        def synchronize(self):
            log.append("sync")

        def destroy(self):
            log.append("destroy stream")

    class DeviceBuffer:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            self.ptr, self.data = memory.alloc(nbytes)

        def free(self):
            memory.freed.append(self.ptr)

    class PinnedBuffer(DeviceBuffer):
        def view(self, dtype, shape):
            count = int(np.prod(shape, dtype=np.int64))
            return self.data[: count * dtype.itemsize].view(dtype).reshape(shape)

    def copy(dst, src, nbytes, stream):
        log.append(("copy", nbytes))
        dst.data[:nbytes] = src.data[:nbytes]

    monkeypatch.setattr(cuda_rt, "set_device", lambda index: None)
    monkeypatch.setattr(cuda_rt, "Stream", Stream)
    monkeypatch.setattr(cuda_rt, "DeviceBuffer", DeviceBuffer)
    monkeypatch.setattr(cuda_rt, "PinnedBuffer", PinnedBuffer)
    monkeypatch.setattr(cuda_rt, "copy_to_device_async", copy)
    monkeypatch.setattr(cuda_rt, "copy_to_host_async", copy)


def _fake_trt(memory: _Memory, log: list, profiles: int, max_batch: int):
    """An engine computing Y = 2 * X + 1 on [-1, 16] FP32, with ``profiles`` profiles."""
    INPUT, OUTPUT = "in", "out"

    class Context:
        def __init__(self):
            self.addr, self.shape, self.profile = {}, None, 0

        def set_optimization_profile_async(self, index, stream):
            self.profile = index

        def set_tensor_address(self, name, ptr):
            self.addr[name] = ptr

        def set_input_shape(self, name, shape):
            self.shape = tuple(shape)
            return True

        def execute_async_v3(self, stream):
            log.append(("execute", self.profile, self.shape))
            n = self.shape[0] * 16 * 4
            x = memory.by_ptr[self.addr["X"]][:n].view(np.float32)
            memory.by_ptr[self.addr["Y"]][:n].view(np.float32)[:] = 2 * x + 1
            return True

    class Engine:
        num_io_tensors = 2
        num_optimization_profiles = profiles

        def get_tensor_name(self, i):
            return ["X", "Y"][i]

        def get_tensor_dtype(self, name):
            return types.SimpleNamespace(name="FLOAT")

        def get_tensor_shape(self, name):
            return (-1, 16)

        def get_tensor_mode(self, name):
            return INPUT if name == "X" else OUTPUT

        def get_tensor_profile_shape(self, name, p):
            return ((1, 16), (8, 16), (max_batch, 16))

        def create_execution_context(self):
            return Context()

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            return Engine() if data == b"PLAN" else None

    trt = types.SimpleNamespace(
        __version__="10.13.0",
        Logger=type("Logger", (), {"WARNING": 1, "ERROR": 2, "__init__": lambda self, level: None}),
        Runtime=Runtime,
        TensorIOMode=types.SimpleNamespace(INPUT=INPUT, OUTPUT=OUTPUT),
    )
    return trt


@pytest.fixture
def fake_trt_engine(monkeypatch, tmp_path: Path):
    from aserve.engines import tensorrt_engine

    memory, log = _Memory(), []
    _fake_cuda(monkeypatch, memory, log)

    def make(profiles: int = 2, engine_max_batch: int = 32, instances: int = 2, plan=b"PLAN"):
        trt = _fake_trt(memory, log, profiles, engine_max_batch)
        monkeypatch.setattr(tensorrt_engine, "import_tensorrt", lambda: trt)
        monkeypatch.setattr("aserve.engines.requirements.engine_problem", lambda e, d: None)
        (tmp_path / "m.plan").write_bytes(plan)
        x = [{"name": "X", "datatype": "FP32", "shape": [16]}]
        entry = {"name": "m", "engine": "tensorrt", "path": "m.plan", "device": "cuda:0",
                 "instances": instances, "inputs": x, "outputs": [{**x[0], "name": "Y"}],
                 "batching": {"max_batch_size": 32}}  # fmt: skip
        cfg = parse_config({"models": [entry]}).models[0]
        return TensorRTEngine(cfg, tmp_path / "m.plan")

    make.memory, make.log = memory, log  # type: ignore[attr-defined]
    return make


def test_each_instance_has_its_context_profile_stream_and_buffers(fake_trt_engine):
    engine = fake_trt_engine()
    engine.load()
    first, second = engine.create_instance(0), engine.create_instance(1)
    assert (first.context.profile, second.context.profile) == (0, 1)
    assert first.stream is not second.stream
    buffers = {t.device.ptr for i in (first, second) for t in (*i.inputs, *i.outputs)}
    assert len(buffers) == 4  # nothing shared between instances
    assert all(t.device.nbytes == 32 * 16 * 4 for t in (*first.inputs, *first.outputs))
    for inst, batch in ((first, 5), (second, 32), (first, 1)):
        x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
        out = engine.run({"X": x}, inst)["Y"]
        np.testing.assert_allclose(out, 2 * x + 1, rtol=1e-6)
    # The output is a copy: the next batch on the instance must not change it.
    out = engine.run({"X": np.zeros((2, 16), np.float32)}, first)["Y"]
    engine.run({"X": np.ones((2, 16), np.float32)}, first)
    assert (out == 1).all()
    log = fake_trt_engine.log
    assert ("execute", 1, (32, 16)) in log and ("copy", 5 * 16 * 4) in log
    engine.unload()
    assert len(fake_trt_engine.memory.freed) == 8  # pinned + device, in and out, x2
    assert log.count("destroy stream") == 2


def test_engine_load_checks_profiles_and_plan(fake_trt_engine):
    with pytest.raises(ValueError, match=r"has 1 optimization profile.s. but instances is 2"):
        fake_trt_engine(profiles=1).load()
    with pytest.raises(ValueError, match=r"profile 0 covers batch 1..16 .*max_batch_size is 32"):
        fake_trt_engine(engine_max_batch=16).load()
    with pytest.raises(RuntimeError, match=r"cannot load m.plan: an engine only loads in the"):
        fake_trt_engine(plan=b"other").load()


def test_serve_reads_a_plans_tensors_from_the_engine(
    monkeypatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """``aserve serve m.plan``'s CPU side, with the stand-in TensorRT: no --input or
    --output, the tensors come from the engine, the device defaults to cuda; an engine
    TensorRT cannot load exits 2 naming the file. (bench/gpu_check.sh serves a real .plan.)"""
    from aserve.cli import main
    from aserve.engines import checks, cuda_rt, tensorrt_engine

    trt = _fake_trt(_Memory(), [], profiles=1, max_batch=32)
    monkeypatch.setattr(tensorrt_engine, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(cuda_rt, "set_device", lambda index: None)
    monkeypatch.setattr("aserve.engines.requirements.engine_problem", lambda e, d: None)
    monkeypatch.setattr(checks, "engine_problem", lambda e, d: None)
    (tmp_path / "m.plan").write_bytes(b"PLAN")
    assert main(["serve", str(tmp_path / "m.plan"), "--print-config"]) == 0
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert (model["engine"], model["device"]) == ("tensorrt", "cuda")
    assert model["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [16]}]
    assert model["outputs"] == [{"name": "Y", "datatype": "FP32", "shape": [16]}]

    (tmp_path / "old.plan").write_bytes(b"built by another TensorRT")
    assert main(["serve", str(tmp_path / "old.plan"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "old.plan: TensorRT 10.13.0 cannot load old.plan" in err, err
