"""The TensorRT engine (``"engine": "tensorrt"``): serialized engines on NVIDIA GPUs.

``path`` is a serialized engine (``.engine`` / ``.plan``), loaded as is, or
an ``.onnx`` model, built into an engine on first use and cached on disk
(:mod:`tensorrt_build`). The config's inputs and outputs are checked against
the engine's own.

Each instance owns an execution context, a non-blocking CUDA stream (made
with cuda-python) and, for every input and output, a device buffer and a
page-locked host buffer sized for ``max_batch_size``, allocated once. A
batch is copied into the host buffers, then copied in, enqueued and copied
out asynchronously on the instance's stream; the instance thread waits on
that stream alone, so instances overlap copies and compute. With dynamic
shapes, instance *i* uses optimization profile *i* (an execution context
needs a profile of its own).

Needs the ``tensorrt`` and ``cuda-python`` packages and a GPU; a config
naming this engine without them is refused at load (:mod:`requirements`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.engines.io_specs import ModelTensor, reconcile
from aserve.types.tensors import numpy_dtype

log = logging.getLogger("aserve.engines.tensorrt")

# TensorRT element types (``trt.DataType`` member names) -> V2 datatypes.
TRT_DATATYPES = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}

ENGINE_SUFFIXES = (".engine", ".plan")


def buffer_bytes(datatype: str, shape: list[int], max_batch_size: int) -> int:
    """Bytes of one tensor's buffers: a whole ``max_batch_size`` batch."""
    if -1 in shape:
        raise ValueError("the tensorrt engine needs fixed dimensions besides the batch")
    count = max_batch_size
    for d in shape:
        count *= d
    return count * numpy_dtype(datatype).itemsize


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError:
        raise RuntimeError(
            "the tensorrt engine needs TensorRT, which is not installed: "
            "pip install 'aserve[tensorrt]' on a machine with an NVIDIA GPU"
        ) from None
    return tensorrt


def describe_engine(trt: Any, engine: Any) -> tuple[list[ModelTensor], list[ModelTensor]]:
    """A deserialized engine's input and output tensors, in its order."""
    ins, outs = [], []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = engine.get_tensor_dtype(name)
        dims = tuple(None if d < 0 else int(d) for d in engine.get_tensor_shape(name))
        t = ModelTensor(name, TRT_DATATYPES.get(dtype.name), dims, dtype.name)
        (ins if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outs).append(t)
    return ins, outs


class _Tensor:
    __slots__ = ("device", "dtype", "host", "name", "nbytes_per_item", "tail")

    def __init__(
        self, name: str, dtype: np.dtype[Any], tail: tuple[int, ...], host: Any, device: Any
    ):
        self.name = name
        self.dtype = dtype
        self.tail = tail
        self.nbytes_per_item = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        self.host = host
        self.device = device


class _Instance:
    """One execution context with its stream and buffers (used by one thread only)."""

    __slots__ = ("context", "inputs", "outputs", "stream")

    def __init__(self, context: Any, stream: Any, inputs: list[_Tensor], outputs: list[_Tensor]):
        self.context = context
        self.stream = stream
        self.inputs = inputs
        self.outputs = outputs


class TensorRTEngine(Engine):
    def __init__(self, config: ModelConfig, model_path: Path) -> None:
        super().__init__(config, model_path)
        self.device_index = int(config.device.partition(":")[2] or 0)
        self._trt: Any = None
        self._runtime: Any = None
        self._logger: Any = None
        self._engine: Any = None
        self._dynamic = False
        self._instances: list[_Instance] = []
        self._lock = threading.Lock()  # guards _instances (appended from instance threads)

    def load(self) -> None:
        from aserve.engines import cuda_rt, tensorrt_build
        from aserve.engines.requirements import engine_problem

        cfg, path = self.config, self.model_path
        problem = engine_problem("tensorrt", cfg.device)
        if problem:
            raise RuntimeError(problem)
        trt = import_tensorrt()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        cuda_rt.set_device(self.device_index)
        b = cfg.batching
        if path.suffix == ".onnx":
            gpu = cuda_rt.device_identity(self.device_index)
            data, cached, built = tensorrt_build.load_or_build(
                trt, path, gpu, cfg.inputs, b.max_batch_size, b.preferred_batch_sizes,
                cfg.precision, cfg.instances,
            )  # fmt: skip
            log.info(
                "model %s: %s TensorRT engine %s", cfg.name, "built" if built else "cached", cached
            )
        elif path.suffix in ENGINE_SUFFIXES:
            data = path.read_bytes()
        else:
            raise ValueError(
                f"the tensorrt engine loads {', '.join(ENGINE_SUFFIXES)} or .onnx files, "
                f"not '{path.name}'"
            )
        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)  # must outlive the runtime
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise RuntimeError(
                f"TensorRT {trt.__version__} cannot load {path.name}: an engine only loads in the "
                "TensorRT version and on the GPU model it was built for (see the log above)"
            )
        self._engine = engine
        ins, outs = describe_engine(trt, engine)
        inputs = reconcile("inputs", cfg.inputs, ins, b.max_batch_size)
        outputs = reconcile("outputs", cfg.outputs, outs, b.max_batch_size)
        self._dynamic = any(None in t.dims for t in ins)
        if self._dynamic:
            self._check_profiles(engine, [t.name for t in ins])
        self.config = cfg.model_copy(update={"inputs": inputs, "outputs": outputs})
        log.info("model %s: TensorRT %s on %s", cfg.name, trt.__version__, cfg.device)

    def _check_profiles(self, engine: Any, names: list[str]) -> None:
        cfg = self.config
        profiles = engine.num_optimization_profiles
        if profiles < cfg.instances:
            raise ValueError(
                f"the engine has {profiles} optimization profile(s) but instances is "
                f"{cfg.instances}: each instance needs a profile of its own (build the engine "
                f"with {cfg.instances} profiles, or serve the .onnx and let aserve build it)"
            )
        want = cfg.batching.max_batch_size
        for p in range(cfg.instances):
            for name in names:
                lo, _, hi = engine.get_tensor_profile_shape(name, p)
                if lo[0] > 1 or hi[0] < want:
                    raise ValueError(
                        f"optimization profile {p} covers batch {lo[0]}..{hi[0]} for input "
                        f"'{name}', but batching.max_batch_size is {want}"
                    )

    def create_instance(self, index: int) -> _Instance:
        from aserve.engines import cuda_rt

        cuda_rt.set_device(self.device_index)
        cfg, max_batch = self.config, self.config.batching.max_batch_size
        stream = cuda_rt.Stream()
        context = self._engine.create_execution_context()
        if context is None:
            raise RuntimeError(f"TensorRT could not create execution context {index} (GPU memory?)")
        if self._dynamic and index:
            context.set_optimization_profile_async(index, stream.ptr)
            stream.synchronize()
        tensors: dict[str, list[_Tensor]] = {"inputs": [], "outputs": []}
        for kind, specs in (("inputs", cfg.inputs), ("outputs", cfg.outputs)):
            for spec in specs:
                nbytes = buffer_bytes(spec.datatype, spec.shape, max_batch)
                t = _Tensor(
                    spec.name,
                    numpy_dtype(spec.datatype),
                    tuple(spec.shape),
                    cuda_rt.PinnedBuffer(nbytes),
                    cuda_rt.DeviceBuffer(nbytes),
                )
                context.set_tensor_address(spec.name, t.device.ptr)
                tensors[kind].append(t)
        inst = _Instance(context, stream, tensors["inputs"], tensors["outputs"])
        with self._lock:
            self._instances.append(inst)
        return inst

    def run(self, inputs: dict[str, np.ndarray], inst: _Instance) -> dict[str, np.ndarray]:
        from aserve.engines import cuda_rt

        context, stream = inst.context, inst.stream
        batch = 0
        for t in inst.inputs:
            arr = inputs[t.name]
            batch = arr.shape[0]
            np.copyto(t.host.view(t.dtype, arr.shape), arr, casting="no")
            cuda_rt.copy_to_device_async(t.device, t.host, arr.nbytes, stream)
            if not context.set_input_shape(t.name, arr.shape):
                raise ValueError(f"TensorRT refused shape {list(arr.shape)} for input '{t.name}'")
        if not context.execute_async_v3(stream.ptr):
            raise RuntimeError(f"TensorRT could not enqueue model '{self.config.name}'")
        for t in inst.outputs:
            cuda_rt.copy_to_host_async(t.host, t.device, batch * t.nbytes_per_item, stream)
        # The only wait: this instance's own stream.
        stream.synchronize()
        # Copies: the pinned buffers are overwritten by this instance's next batch.
        return {t.name: t.host.view(t.dtype, (batch, *t.tail)).copy() for t in inst.outputs}

    def unload(self) -> None:
        if self._engine is None:
            return
        from aserve.engines import cuda_rt

        cuda_rt.set_device(self.device_index)
        with self._lock:
            instances, self._instances = self._instances, []
        for inst in instances:
            inst.stream.synchronize()
            inst.context = None
            for t in (*inst.inputs, *inst.outputs):
                t.host.free()
                t.device.free()
            inst.stream.destroy()
        self._engine = None
        self._runtime = None
