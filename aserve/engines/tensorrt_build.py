"""Building TensorRT engines from ONNX, and the on-disk cache of built engines.

A build takes seconds to minutes, so a built engine is kept in
``$ASERVE_CACHE_DIR/tensorrt`` (default ``~/.cache/aserve/tensorrt``) under a
key made of everything that changes the result: the model's bytes (the
``.onnx`` file and its ``.onnx.data`` weights, when present), the TensorRT
version, the GPU (name and compute capability), the precision and the
optimization profiles. A changed model, an upgraded TensorRT or another GPU
builds anew; nothing stale is ever loaded.

The profile covers batch sizes 1..``max_batch_size``, tuned (``opt``) for the
largest preferred batch size. Each instance gets a profile of its own,
because an execution context of a dynamic-shape engine needs one.

fp16: TensorRT 10 is asked for fp16 kernels with its builder flag. TensorRT 11
removed that flag (networks are strongly typed), so the ONNX model is first
converted to fp16 with fp32 inputs and outputs (``onnxconverter-common``).

Everything but :func:`build_serialized` runs without TensorRT or a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aserve.config import TensorSpec, paths

log = logging.getLogger("aserve.engines.tensorrt")

# Bump when aserve changes how it builds (flags, profile layout) so old cache entries stop matching.
BUILD_REVISION = 1
WORKSPACE_BYTES = 4 << 30


def cache_dir() -> Path:
    return paths.cache_dir() / "tensorrt"


def model_digest(onnx_path: Path) -> str:
    """sha256 of the model's bytes: the ``.onnx`` file and its ``.onnx.data`` beside it."""
    h = hashlib.sha256()
    for part in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        if part.is_file():
            h.update(part.name.encode() + b"\0")
            with part.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def optimization_profile(
    inputs: Sequence[TensorSpec], max_batch_size: int, preferred: Sequence[int]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``{input: (min, opt, max)}`` shapes covering batch 1..``max_batch_size``.

    Other dimensions must be fixed: a range for them is not something the
    config can say, so a model with a variable dimension is built by hand
    (``trtexec``) and served from its ``.plan``.
    """
    opt = max(preferred) if preferred else max_batch_size
    profile = {}
    for spec in inputs:
        if -1 in spec.shape:
            raise ValueError(
                f"input '{spec.name}' has a variable dimension {spec.shape}: building a TensorRT "
                "engine from ONNX needs fixed dimensions besides the batch; build the engine "
                "with trtexec and serve the .plan"
            )
        dims = tuple(spec.shape)
        profile[spec.name] = ((1, *dims), (opt, *dims), (max_batch_size, *dims))
    return profile


def cache_key(
    digest: str,
    trt_version: str,
    gpu: str,
    precision: str,
    profile: dict[str, tuple[tuple[int, ...], ...]],
    profiles: int,
) -> str:
    """The hex key of one build; any change to an argument changes it."""
    shapes = ";".join(f"{name}={shape}" for name, shape in sorted(profile.items()))
    text = "\n".join(
        [
            f"rev={BUILD_REVISION}",
            f"model={digest}",
            f"tensorrt={trt_version}",
            f"gpu={gpu}",
            f"precision={precision}",
            f"profiles={profiles}",
            f"shapes={shapes}",
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def cached_engine_path(onnx_path: Path, key: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / f"{onnx_path.stem}-{key[:24]}.engine"


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def convert_to_fp16(onnx_path: Path, out_path: Path) -> Path:
    """An fp16 copy of the model with fp32 inputs and outputs (for TensorRT 11+)."""
    try:
        import onnx
        from onnxconverter_common import float16
    except ImportError:
        raise RuntimeError(
            "precision fp16 with TensorRT 11 or newer converts the ONNX model first, which needs "
            "onnx and onnxconverter-common: pip install 'aserve[tensorrt]'"
        ) from None
    model = onnx.load(str(onnx_path))  # external .onnx.data weights load from beside it
    converted = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(converted, str(out_path))
    return out_path


def build_serialized(
    trt: Any,
    onnx_path: Path,
    profile: dict[str, tuple[tuple[int, ...], ...]],
    profiles: int,
    precision: str,
) -> bytes:
    """Build a serialized engine from ``onnx_path`` (needs TensorRT and a GPU)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only kind since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    # Everything up to the build stays in the block: the parser may read the
    # converted file's weights lazily.
    with tempfile.TemporaryDirectory(prefix="aserve-trt-") as tmp:
        source = onnx_path
        if precision == "fp16":
            if hasattr(trt.BuilderFlag, "FP16"):
                config.set_flag(trt.BuilderFlag.FP16)
            else:
                source = convert_to_fp16(onnx_path, Path(tmp) / onnx_path.name)
        if not parser.parse_from_file(str(source)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
        for _ in range(profiles):
            p = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile.items():
                p.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(p)
        log.info(
            "building a TensorRT %s engine from %s (%d profile(s), batch 1..%d); "
            "this can take minutes",
            precision, onnx_path.name, profiles, max(s[2][0] for s in profile.values()),
        )  # fmt: skip
        serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT could not build an engine from {onnx_path.name}")
    return bytes(serialized)


def load_or_build(
    trt: Any,
    onnx_path: Path,
    gpu: str,
    inputs: Sequence[TensorSpec],
    max_batch_size: int,
    preferred: Sequence[int],
    precision: str,
    profiles: int,
    folder: Path | None = None,
) -> tuple[bytes, Path, bool]:
    """``(serialized engine, its cache file, whether it was built now)``."""
    profile = optimization_profile(inputs, max_batch_size, preferred)
    key = cache_key(model_digest(onnx_path), trt.__version__, gpu, precision, profile, profiles)
    path = cached_engine_path(onnx_path, key, folder)
    if path.is_file():
        return path.read_bytes(), path, False
    data = build_serialized(trt, onnx_path, profile, profiles, precision)
    write_atomically(path, data)
    return data, path, True
