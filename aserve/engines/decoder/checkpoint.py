"""Reading a model folder in the common Hugging Face layout.

``config.json`` names the family; weights come only from ``*.safetensors``
files (no pickles). Errors name the folder and what is missing or unsupported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aserve.engines.decoder import gpt2, llama
from aserve.engines.decoder.spec import CheckpointError, ModelSpec, StateDict, Weights

log = logging.getLogger("aserve.engines.decoder")

FAMILIES = {"gpt2": gpt2, "llama": llama}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the top level must be a JSON object")
    return data


def read_spec(folder: Path) -> ModelSpec:
    """The model's shape from ``config.json``; raises for families we do not run."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    config = read_json(path)
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported by the decoder engine "
            f"(supported: {supported})"
        )
    return family.spec_from_config(config, str(path))


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the model, shards included."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return [folder / name for name in sorted(set(weight_map.values()))]
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


def load_weights(
    folder: Path, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> Weights:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file listed in the index is missing")
        for name, t in load_file(str(path), device=str(device)).items():
            # Non-float buffers (old GPT-2 files store boolean attention masks) keep their type.
            tensors[name] = t.to(dtype) if t.is_floating_point() else t
    sd = StateDict(tensors, str(folder))
    weights = FAMILIES[spec.family].weights_from_state(spec, sd)
    unused = sd.unused()
    if unused:
        log.debug("%s: %d tensors not used (e.g. %s)", folder, len(unused), unused[0])
    _check_shapes(spec, weights, folder)
    return weights


def _check_shapes(spec: ModelSpec, w: Weights, folder: Path) -> None:
    expected = {
        "embedding": (w.embed.shape, (spec.vocab_size, spec.hidden_size)),
        "lm_head": (w.lm_head.shape, (spec.vocab_size, spec.hidden_size)),
        "layer 0 q/k/v": (
            w.layers[0].qkv_w.shape,
            (spec.q_size + 2 * spec.kv_size, spec.hidden_size),
        ),
    }
    for what, (got, want) in expected.items():
        if tuple(got) != want:
            raise CheckpointError(
                f"{folder}: {what} weight has shape {tuple(got)}, config.json implies {want}"
            )
