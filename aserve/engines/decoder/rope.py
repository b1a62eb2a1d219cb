"""Rotary position embeddings: the cos/sin tables and their application.

Tables are computed once per model in float32, the way Hugging Face computes
them, so positions rotate identically to the reference implementation.
"""

from __future__ import annotations

import math

import torch

from aserve.engines.decoder.spec import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept,
        # the band between interpolated smoothly.
        low_wavelen = rope.original_max_positions / rope.low_freq_factor
        high_wavelen = rope.original_max_positions / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    rope: RopeSpec, head_dim: int, positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin``, each (positions, head_dim), in the model's dtype."""
    inv_freq = inverse_frequencies(rope, head_dim)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, len, head_dim) by per-token ``cos``/``sin`` (batch, 1, len, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
