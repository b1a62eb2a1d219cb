"""What an engine needs on this machine, checked when a config is loaded.

A config naming an engine whose packages (or GPU) are missing is refused
with the config's other errors (``models[i].engine: ...``, exit status 2)
rather than when the model loads. The checks find packages without
importing them, except that TensorRT's GPU check asks the CUDA runtime
for its devices through cuda-python (fast, and only when both are there).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

Finder = Callable[[str], Any]


def _has(name: str, find: Finder) -> bool:
    try:
        return find(name) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def cuda_runtime_module() -> Any:
    """cuda-python's runtime API module (``cuda.bindings.runtime``, or the older ``cuda.cudart``)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        from cuda import cudart as runtime  # type: ignore[no-redef]  # cuda-python < 12.6
    return runtime


def cuda_device_count() -> tuple[int, str | None]:
    """``(devices, why)``: how many CUDA devices the runtime sees, and why none when 0."""
    try:
        rt = cuda_runtime_module()
        err, count = rt.cudaGetDeviceCount()
    except Exception as exc:  # a broken driver install raises from the bindings' loader
        return 0, f"the CUDA runtime did not load ({exc})"
    if int(err) != 0:
        name = rt.cudaGetErrorName(err)[1]
        return 0, f"cudaGetDeviceCount failed: {name.decode() if isinstance(name, bytes) else name}"
    return int(count), None if count else "the CUDA runtime sees no device"


def engine_problem(
    engine: str,
    device: str,
    find: Finder | None = None,
    device_count: Callable[[], tuple[int, str | None]] | None = None,
) -> str | None:
    """Why ``engine`` cannot serve on ``device`` here, or ``None`` when it can.

    ``find`` and ``device_count`` default to the real look-ups (tests pass fakes).
    """
    find = find or importlib.util.find_spec
    device_count = device_count or cuda_device_count
    if engine == "onnx":
        if not _has("onnxruntime", find):
            return (
                "the onnx engine needs onnxruntime, which is not installed: "
                "pip install 'aserve[onnx]' (onnxruntime-gpu for CUDA devices)"
            )
        return None
    if engine == "tensorrt":
        if not _has("tensorrt", find):
            return (
                "the tensorrt engine needs TensorRT, which is not installed: "
                "pip install 'aserve[tensorrt]' on a machine with an NVIDIA GPU"
            )
        if not (_has("cuda.bindings", find) or _has("cuda.cudart", find)):
            return (
                "the tensorrt engine needs cuda-python for its streams and buffers, "
                "which is not installed: pip install 'aserve[tensorrt]'"
            )
        count, why = device_count()
        if count == 0:
            return f"the tensorrt engine needs an NVIDIA GPU: {why}"
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            return f"device '{device}' requested, but only {count} CUDA device(s) are visible"
        return None
    return None
