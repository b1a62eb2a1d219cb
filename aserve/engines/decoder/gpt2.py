"""GPT-2 checkpoints (``model_type: gpt2``) in Hugging Face's layout.

GPT-2 stores its projections as ``Conv1D`` weights, (in_features,
out_features); they are transposed once here to the ``linear`` layout.
"""

from __future__ import annotations

from typing import Any

import torch

from aserve.engines.decoder.spec import (
    CheckpointError,
    LayerWeights,
    ModelSpec,
    StateDict,
    Weights,
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


def spec_from_config(config: dict[str, Any], source: str) -> ModelSpec:
    hidden = config_int(config, "n_embd", source)
    heads = config_int(config, "n_head", source)
    layers = config_int(config, "n_layer", source)
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
        vocab_size=config_int(config, "vocab_size", source),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        max_positions=config_int(config, "n_positions", source),
        norm="layernorm",
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        activation=_ACTIVATIONS[act],  # type: ignore[arg-type]
        gated_mlp=False,
        rope=None,
        attn_scales=tuple(scales),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def weights_from_state(spec: ModelSpec, sd: StateDict) -> Weights:
    # GPT2LMHeadModel saves "transformer.*"; a bare GPT2Model (the original
    # openai-community/gpt2 files) has no prefix.
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
