"""Llama-family checkpoints (``model_type: llama``) in Hugging Face's layout.

Covers grouped-query attention (``num_key_value_heads`` < heads), an explicit
``head_dim``, attention/MLP biases, tied embeddings, and the default, linear
and llama3 RoPE variants, with the RoPE settings read from either the
transformers 5 ``rope_parameters`` block or the older ``rope_theta`` /
``rope_scaling`` keys.
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
    RopeSpec,
    StateDict,
    Weights,
    config_float,
    config_int,
)

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def spec_from_config(
    config: dict[str, Any], source: str, limits: CheckpointLimits | None = None
) -> ModelSpec:
    hidden = config_int(config, "hidden_size", source, limits, "max_hidden_size")
    heads = config_int(config, "num_attention_heads", source, limits, "max_heads")
    kv_heads = config_int(config, "num_key_value_heads", source, limits, "max_heads", heads)
    layers = config_int(config, "num_hidden_layers", source, limits, "max_layers")
    vocab = config_int(config, "vocab_size", source, limits, "max_vocab_size")
    positions = config_int(config, "max_position_embeddings", source, limits, "max_positions")
    inner = config_int(config, "intermediate_size", source, limits, "max_intermediate_size")
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = config_int(
        config, "head_dim", source, limits, "max_hidden_size", max(1, hidden // heads)
    )
    act = config.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act '{act}' is not supported")
    return ModelSpec(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=inner,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_positions=positions,
        norm="rmsnorm",
        norm_eps=config_float(config, "rms_norm_eps", source, 1e-6),
        activation=_ACTIVATIONS[act],  # type: ignore[arg-type]
        gated_mlp=True,
        rope=_rope(config, source),
        attn_scales=(head_dim**-0.5,) * layers,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def tensor_shapes(spec: ModelSpec, names: Collection[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor :func:`weights_from_state` takes from files holding ``names``
    (the optional biases where the files have them), with the shape ``spec``
    implies (``linear`` layout: out, in)."""
    d, inner, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q, kv = spec.q_size, spec.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm": (d,), "post_attention_layernorm": (d,),
            "self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
            "self_attn.o_proj": (d, q),
            "mlp.gate_proj": (inner, d), "mlp.up_proj": (inner, d), "mlp.down_proj": (d, inner),
        }  # fmt: skip
        for module, shape in layer.items():
            shapes[f"{p}{module}.weight"] = shape
            if "proj" in module and f"{p}{module}.bias" in names:
                shapes[f"{p}{module}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def layer_of(name: str) -> int | None:
    """The block a tensor belongs to (``model.layers.<i>.``), if it belongs to one."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _rope(config: dict[str, Any], source: str) -> RopeSpec:
    params = config.get("rope_parameters")
    if params is None:  # transformers < 5: rope_theta + rope_scaling
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor is not supported")
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
        )
    raise CheckpointError(
        f"{source}: rope type '{kind}' is not supported (supported: default, linear, llama3)"
    )


def weights_from_state(spec: ModelSpec, sd: StateDict) -> Weights:
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
        gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        layers.append(
            LayerWeights(
                norm1_w=sd.take(p + "input_layernorm.weight"),
                norm1_b=None,
                qkv_w=torch.cat([sd.take(n + ".weight") for n in attn]),
                qkv_b=_fused_bias(sd, attn),
                o_w=sd.take(p + "self_attn.o_proj.weight"),
                o_b=sd.maybe(p + "self_attn.o_proj.bias"),
                norm2_w=sd.take(p + "post_attention_layernorm.weight"),
                norm2_b=None,
                up_w=torch.cat([sd.take(n + ".weight") for n in gate_up]),
                up_b=_fused_bias(sd, gate_up),
                down_w=sd.take(p + "mlp.down_proj.weight"),
                down_b=sd.maybe(p + "mlp.down_proj.bias"),
            )
        )
    embed = sd.take("model.embed_tokens.weight")
    head = embed if spec.tie_word_embeddings else sd.take("lm_head.weight")
    return Weights(
        embed=embed,
        pos_embed=None,
        layers=layers,
        final_norm_w=sd.take("model.norm.weight"),
        final_norm_b=None,
        lm_head=head,
    )


def _fused_bias(sd: StateDict, names: list[str]) -> torch.Tensor | None:
    """The biases of projections fused into one matmul: all or none."""
    biases = [sd.maybe(n + ".bias") for n in names]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    if len(present) != len(biases):
        raise CheckpointError(f"{names[0]}: some of {names} have a bias and others not")
    return torch.cat(present)
