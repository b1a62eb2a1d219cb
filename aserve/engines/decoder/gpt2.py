"""GPT-2 checkpoints (``model_type: gpt2``) in Hugging Face's layout.

GPT-2 stores its projections as ``Conv1D`` weights, (in_features,
out_features); they are transposed once here to the ``linear`` layout.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

from aserve.config.schema import CheckpointLimits
from aserve.engines.decoder.spec import (
    CheckpointError,
    LayerWeights,
    ModelSpec,
    StateDict,
    Weights,
    config_float,
    config_int,
)

# Names Hugging Face uses for GPT-2's activations -> ours.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_LAYER = re.compile(r"^(?:transformer\.)?h\.(\d+)\.")


def spec_from_config(
    config: dict[str, Any], source: str, limits: CheckpointLimits | None = None
) -> ModelSpec:
    hidden = config_int(config, "n_embd", source, limits, "max_hidden_size")
    heads = config_int(config, "n_head", source, limits, "max_heads")
    layers = config_int(config, "n_layer", source, limits, "max_layers")
    vocab = config_int(config, "vocab_size", source, limits, "max_vocab_size")
    positions = config_int(config, "n_positions", source, limits, "max_positions")
    inner = config_int(config, "n_inner", source, limits, "max_intermediate_size", 4 * hidden)
    if hidden % heads:
        raise CheckpointError(f"{source}: n_embd ({hidden}) is not a multiple of n_head ({heads})")
    if config.get("add_cross_attention"):
        raise CheckpointError(f"{source}: GPT-2 with cross-attention is not a causal LM")
    act = config.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{source}: activation_function '{act}' is not supported")
    head_dim = hidden // heads
    scales = []
    for i in range(layers):
        scale = head_dim**-0.5 if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(i + 1)
        scales.append(scale)
    return ModelSpec(
        family="gpt2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=inner,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        max_positions=positions,
        norm="layernorm",
        norm_eps=config_float(config, "layer_norm_epsilon", source, 1e-5),
        activation=_ACTIVATIONS[act],  # type: ignore[arg-type]
        gated_mlp=False,
        rope=None,
        attn_scales=tuple(scales),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def _prefix(names: Collection[str]) -> str:
    # GPT2LMHeadModel saves "transformer.*"; a bare GPT2Model (the original
    # openai-community/gpt2 files) has no prefix.
    return "transformer." if "transformer.wte.weight" in names else ""


def tensor_shapes(spec: ModelSpec, names: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor :func:`weights_from_state` takes from files holding ``names``,
    with the shape ``spec`` implies (``Conv1D`` layout: in, out)."""
    p = _prefix(names)
    d, inner, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {p + "wte.weight": (v, d)}
    shapes[p + "wpe.weight"] = (spec.max_positions, d)
    for i in range(spec.num_layers):
        h = f"{p}h.{i}."
        shapes |= {
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, inner), h + "mlp.c_fc.bias": (inner,),
            h + "mlp.c_proj.weight": (inner, d), h + "mlp.c_proj.bias": (d,),
        }  # fmt: skip
    shapes[p + "ln_f.weight"] = shapes[p + "ln_f.bias"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def layer_of(name: str) -> int | None:
    """The block a tensor belongs to (``h.<i>.``), if it belongs to one."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def weights_from_state(spec: ModelSpec, sd: StateDict) -> Weights:
    p = "transformer." if sd.has("transformer.wte.weight") else ""
    layers = []
    for i in range(spec.num_layers):
        h = f"{p}h.{i}."
        layers.append(
            LayerWeights(
                norm1_w=sd.take(h + "ln_1.weight"),
                norm1_b=sd.take(h + "ln_1.bias"),
                qkv_w=_conv1d(sd.take(h + "attn.c_attn.weight")),
                qkv_b=sd.take(h + "attn.c_attn.bias"),
                o_w=_conv1d(sd.take(h + "attn.c_proj.weight")),
                o_b=sd.take(h + "attn.c_proj.bias"),
                norm2_w=sd.take(h + "ln_2.weight"),
                norm2_b=sd.take(h + "ln_2.bias"),
                up_w=_conv1d(sd.take(h + "mlp.c_fc.weight")),
                up_b=sd.take(h + "mlp.c_fc.bias"),
                down_w=_conv1d(sd.take(h + "mlp.c_proj.weight")),
                down_b=sd.take(h + "mlp.c_proj.bias"),
            )
        )
    embed = sd.take(p + "wte.weight")
    head = embed if spec.tie_word_embeddings else sd.take("lm_head.weight")
    return Weights(
        embed=embed,
        pos_embed=sd.take(p + "wpe.weight"),
        layers=layers,
        final_norm_w=sd.take(p + "ln_f.weight"),
        final_norm_b=sd.take(p + "ln_f.bias"),
        lm_head=head,
    )


def _conv1d(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()
