"""Reading a model folder in the common Hugging Face layout.

``config.json`` names the family; weights come only from ``*.safetensors``
files (no pickles). Errors name the folder and what is missing or unsupported.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aserve.config.schema import CheckpointLimits
from aserve.engines.decoder import gpt2, llama
from aserve.engines.decoder.spec import (
    LIMITS_KEY,
    CheckpointError,
    ModelSpec,
    StateDict,
    Weights,
)
from aserve.engines.decoder.tensor_headers import TensorHeader, open_regular, read_headers

log = logging.getLogger("aserve.engines.decoder")

FAMILIES = {"gpt2": gpt2, "llama": llama}
# The files beside the weights that the engine reads, and the limit each is held to.
SIDE_FILES = {
    "config.json": "max_config_file_bytes",
    "generation_config.json": "max_config_file_bytes",
    "tokenizer_config.json": "max_config_file_bytes",
    "model.safetensors.index.json": "max_config_file_bytes",
    "chat_template.jinja": "max_config_file_bytes",
    "tokenizer.json": "max_tokenizer_bytes",
}


def read_bounded(path: Path, max_bytes: int, limit: str) -> bytes:
    """The bytes of ``path``; past ``max_bytes`` (the limit named ``limit``)
    it is refused before it is read."""
    with open_regular(path) as (f, info):
        _check_size(path, info.st_size, max_bytes, limit)
        data = f.read(max_bytes + 1)  # it may have grown since
    _check_size(path, len(data), max_bytes, limit)
    return data


def check_file_size(path: Path, limits: CheckpointLimits) -> None:
    """Refuse ``path`` (one of :data:`SIDE_FILES`) if it is over its limit; absent is fine."""
    limit = SIDE_FILES[path.name]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    _check_size(path, size, getattr(limits, limit), limit)


def _check_size(path: Path, size: int, max_bytes: int, limit: str) -> None:
    if size > max_bytes:
        raise CheckpointError(
            f"{path}: {size} bytes, over the limit {LIMITS_KEY}.{limit} ({max_bytes} bytes); "
            "raise it in the model's config if the file is genuine"
        )


def read_json(path: Path, limits: CheckpointLimits | None = None) -> dict[str, Any]:
    """A JSON object from one of :data:`SIDE_FILES`, its size checked first."""
    limit = SIDE_FILES.get(path.name, "max_config_file_bytes")
    raw = read_bounded(path, getattr(limits or CheckpointLimits(), limit), limit)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the top level must be a JSON object")
    return data


def read_spec(folder: Path, limits: CheckpointLimits | None = None) -> ModelSpec:
    """The model's shape from ``config.json``; raises for families we do not run
    and for sizes over ``limits`` (checked before anything is built from them)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    config = read_json(path, limits)
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported by the decoder engine "
            f"(supported: {supported})"
        )
    try:
        return family.spec_from_config(config, str(path), limits or CheckpointLimits())
    except CheckpointError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a value of the wrong kind
        raise CheckpointError(f"{path}: unexpected value: {type(exc).__name__}: {exc}") from None


def weight_files(folder: Path, limits: CheckpointLimits | None = None) -> list[Path]:
    """The safetensors files holding the model, shards included."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, limits).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        names = sorted({str(v) for v in weight_map.values()})
        for name in names:
            # Shards beside the index, nowhere else.
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise CheckpointError(
                    f"{index}: shard {name!r} is not a .safetensors file in the model folder"
                )
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder}: only pickled weights (.bin/.pt) found; the decoder engine loads "
            "safetensors only (re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"{folder}: no *.safetensors weights")


def check_weights(
    folder: Path, spec: ModelSpec, limits: CheckpointLimits | None = None
) -> list[Path]:
    """The weight files, once their headers hold every tensor ``spec`` implies,
    each with its shape, and no block past ``spec.num_layers``. Reads headers
    only: a config.json that does not match its weights is refused before a
    tensor is read or a layer allocated."""
    files = weight_files(folder, limits)
    held: dict[str, TensorHeader] = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file listed in the index is missing")
        for name, header in read_headers(path).items():
            if name in held:
                raise CheckpointError(f"{path}: tensor '{name}' is in more than one file")
            held[name] = header
    family = FAMILIES[spec.family]
    expected = family.tensor_shapes(spec, held.keys())
    implied = sum(math.prod(shape) for shape in expected.values())
    present = sum(h.numel for h in held.values() if h.is_float)

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{folder}: {problem}; config.json ({_sizes(spec)}) implies {implied:,} "
            f"parameters, the safetensors files hold {present:,}"
        )

    for name, shape in expected.items():
        header = held.get(name)
        if header is None:
            raise refuse(f"weight '{name}' is missing")
        if header.shape != shape:
            raise refuse(
                f"weight '{name}' has shape {list(header.shape)}, config.json implies {list(shape)}"
            )
        if not header.is_float:
            raise refuse(f"weight '{name}' is {header.dtype}, not a floating-point type")
    beyond = max((i for n in held if (i := family.layer_of(n)) is not None), default=-1)
    if beyond >= spec.num_layers:
        raise refuse(f"the files hold block {beyond}, past the {spec.num_layers} layers declared")
    return files


def _sizes(spec: ModelSpec) -> str:
    return (
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads, "
        f"vocabulary {spec.vocab_size}, {spec.max_positions} positions, "
        f"MLP {spec.intermediate_size}"
    )


def load_weights(
    folder: Path,
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    limits: CheckpointLimits | None = None,
) -> Weights:
    tensors: dict[str, torch.Tensor] = {}
    for path in check_weights(folder, spec, limits):
        for name, t in load_file(str(path), device=str(device)).items():
            # Non-float buffers (old GPT-2 files store boolean attention masks) keep their type.
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
    sd = StateDict(tensors, str(folder))
    weights = FAMILIES[spec.family].weights_from_state(spec, sd)
    unused = sd.unused()
    if unused:
        log.debug("%s: %d tensors not used (e.g. %s)", folder, len(unused), unused[0])
    return weights


def check_folder(folder: Path, limits: CheckpointLimits | None = None) -> ModelSpec:
    """What can be checked of a model folder without building anything: its
    config.json against ``limits``, the weights' headers against the config,
    the sizes of the files beside them. Reads config.json and the headers only."""
    limits = limits or CheckpointLimits()
    spec = read_spec(folder, limits)
    check_weights(folder, spec, limits)
    for name in SIDE_FILES:
        check_file_size(folder / name, limits)
    return spec
