"""What our one transformer implementation needs to know about a checkpoint.

Each family module (``gpt2``, ``llama``) turns a Hugging Face ``config.json``
into a :class:`ModelSpec` and a state dict into :class:`Weights`; the forward
pass in ``model.py`` reads only these, never family names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from aserve.config.schema import CheckpointLimits


class CheckpointError(ValueError):
    """A model folder we cannot load: the message names the file and the key."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding, Hugging Face's non-interleaved layout."""

    theta: float
    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    family: Literal["gpt2", "llama"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # the MLP's width (gated: of each of gate and up)
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    head_dim: int
    max_positions: int
    norm: Literal["layernorm", "rmsnorm"]
    norm_eps: float
    activation: Literal["gelu_tanh", "gelu", "relu", "silu"]
    gated_mlp: bool  # SwiGLU-style: act(gate(x)) * up(x)
    rope: RopeSpec | None  # None: learned absolute position embeddings
    attn_scales: tuple[float, ...]  # one per layer (GPT-2 may scale by 1/(layer+1))
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    """One block, in ``torch.nn.functional.linear`` layout (out_features, in_features).

    q, k and v are fused into one matrix (and gate/up into one) so a block
    does one matmul where the checkpoint has three (or two).
    """

    norm1_w: torch.Tensor
    norm1_b: torch.Tensor | None
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor | None
    up_w: torch.Tensor  # gated MLP: [gate; up] stacked
    up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


@dataclass
class Weights:
    embed: torch.Tensor  # (vocab, hidden)
    pos_embed: torch.Tensor | None  # (max_positions, hidden), learned positions only
    layers: list[LayerWeights]
    final_norm_w: torch.Tensor
    final_norm_b: torch.Tensor | None
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied


class StateDict:
    """Tensors by name that complains, naming the folder, when one is missing."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        self._tensors = tensors
        self._source = source
        self._used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        try:
            t = self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self._source}: weight '{name}' is missing") from None
        self._used.add(name)
        return t

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self._tensors else None

    def has(self, name: str) -> bool:
        return name in self._tensors

    def unused(self) -> list[str]:
        return sorted(set(self._tensors) - self._used)

    def used(self) -> set[str]:
        return set(self._used)


LIMITS_KEY = "generation.checkpoint_limits"


def config_int(
    config: dict[str, object],
    key: str,
    source: str,
    limits: CheckpointLimits | None = None,
    limit: str | None = None,
    default: int | None = None,
) -> int:
    """``config[key]``, a positive integer (``default`` when absent or null), at
    most ``limits.<limit>``: refused before anything is built with it."""
    value = config.get(key)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{source}: '{key}' must be a positive integer (got {value!r})")
    if limits is not None and limit is not None and value > getattr(limits, limit):
        raise CheckpointError(
            f"{source}: '{key}' is {value}, over the limit {LIMITS_KEY}.{limit} "
            f"({getattr(limits, limit)}); raise it in the model's config if the model is that large"
        )
    return value


def config_float(config: dict[str, object], key: str, source: str, default: float) -> float:
    """``config[key]``, a finite number (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"{source}: '{key}' must be a finite number (got {value!r})")
    return float(value)
