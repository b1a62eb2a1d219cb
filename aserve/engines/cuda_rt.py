"""A thin layer over cuda-python's runtime API: streams, device and pinned buffers, copies.

Used by the TensorRT engine, whose instances each own a stream and buffers.
Every call checks its status and raises :class:`CudaError` naming the call
and the error. Everything here runs on executor threads (or in ``load``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from aserve.engines.requirements import cuda_runtime_module


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


_rt: Any = None


def rt() -> Any:
    global _rt
    if _rt is None:
        _rt = cuda_runtime_module()
    return _rt


def check(call: str, result: Any) -> Any:
    """The value(s) of a cuda-python call's ``(err, *values)`` result; raises on error."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        name = rt().cudaGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise CudaError(f"{call} failed: {name} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def set_device(index: int) -> None:
    check("cudaSetDevice", rt().cudaSetDevice(index))


def device_identity(index: int) -> str:
    """The GPU's name and compute capability, e.g. ``NVIDIA H200 sm90`` (for cache keys)."""
    props = check("cudaGetDeviceProperties", rt().cudaGetDeviceProperties(index))
    name = props.name
    if isinstance(name, (bytes, bytearray)):
        name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    return f"{str(name).strip()} sm{props.major}{props.minor}"


class Stream:
    """A non-blocking CUDA stream (it does not synchronize with the legacy default stream)."""

    def __init__(self) -> None:
        r = rt()
        flags = getattr(r, "cudaStreamNonBlocking", 1)  # the value is 1 in every CUDA
        self.handle = check("cudaStreamCreateWithFlags", r.cudaStreamCreateWithFlags(flags))

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        check("cudaStreamSynchronize", rt().cudaStreamSynchronize(self.handle))

    def destroy(self) -> None:
        if self.handle is not None:
            check("cudaStreamDestroy", rt().cudaStreamDestroy(self.handle))
            self.handle = None


class DeviceBuffer:
    """``nbytes`` of device memory."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = int(check("cudaMalloc", rt().cudaMalloc(max(nbytes, 1))))

    def free(self) -> None:
        if self.ptr:
            check("cudaFree", rt().cudaFree(self.ptr))
            self.ptr = 0


class PinnedBuffer:
    """``nbytes`` of page-locked host memory, viewable as a numpy array."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = int(check("cudaMallocHost", rt().cudaMallocHost(max(nbytes, 1))))
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.ptr)
        self._bytes = np.frombuffer(raw, dtype=np.uint8)

    def view(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """The first ``prod(shape)`` elements as an array of ``shape`` (no copy)."""
        count = int(np.prod(shape, dtype=np.int64))
        return self._bytes[: count * dtype.itemsize].view(dtype).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            self._bytes = np.empty(0, np.uint8)
            check("cudaFreeHost", rt().cudaFreeHost(self.ptr))
            self.ptr = 0


def copy_to_device_async(dst: DeviceBuffer, src: PinnedBuffer, nbytes: int, stream: Stream) -> None:
    r = rt()
    check(
        "cudaMemcpyAsync(H2D)",
        r.cudaMemcpyAsync(
            dst.ptr, src.ptr, nbytes, r.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.handle
        ),
    )


def copy_to_host_async(dst: PinnedBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
    r = rt()
    check(
        "cudaMemcpyAsync(D2H)",
        r.cudaMemcpyAsync(
            dst.ptr, src.ptr, nbytes, r.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream.handle
        ),
    )
