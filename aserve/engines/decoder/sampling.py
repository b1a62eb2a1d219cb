"""Choosing the next token from logits, per sequence.

Every sequence has its own ``torch.Generator`` and draws exactly one uniform
number per sampled token from it, so a seeded request produces the same
tokens whatever else shares its batch, and greedy rows draw nothing. The
filtering (temperature, top-k, top-p) is vectorized over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aserve.errors import InvalidArgument

_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. Validation errors name the field and the value.

    ``temperature`` 0 (or below 1e-5, where dividing by it would overflow)
    is greedy, and top-k/top-p/seed then do not matter.
    ``top_k`` 0 and ``top_p`` 1 disable those filters. ``max_tokens`` None
    means the engine's default. Text equal to one of ``stop`` ends the
    sequence and is not returned; so does a token in ``stop_token_ids`` or,
    unless ``ignore_eos``, an end-of-sequence token.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 <= self.top_k < 2**63:  # the step's tensors and wire carry 64 bits
            raise InvalidArgument(
                f"top_k must be >= 0 and < 2**63, 0 for no limit (got {self.top_k})"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2**64) (got {self.seed})")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW


def make_generator(seed: int | None) -> torch.Generator:
    """A sequence's own random stream: seeded, or from the OS when ``seed`` is None."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k then top-p, sorted by descending logit.

    ``logits`` (n, vocab); the others (n,), with ``top_k`` 0 for no limit.
    Returns ``(probs, token_ids)``, both (n, m) with m <= vocab: probabilities
    of filtered-out tokens are 0, the rest are renormalized to sum to 1.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    widest = int(k.max())
    scaled = logits.float() / temperature[:, None]
    if widest < vocab:  # every row has a top-k: no need to sort the whole vocabulary
        values, ids = scaled.topk(widest, dim=-1)
    else:
        values, ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(values.shape[-1], device=values.device)
    values = values.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    if bool((top_p < 1).any()):
        # Keep the smallest prefix whose mass reaches top_p: a token stays if
        # the mass strictly before it is still short of top_p (the first
        # token always stays).
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token per row of ``logits`` (n, vocab), by each row's own params and generator."""
    n = logits.shape[0]
    tokens = logits.argmax(dim=-1)
    rows = [i for i in range(n) if not params[i].greedy]
    if rows:
        device = logits.device
        sel = torch.tensor(rows, device=device)
        ps = [params[i] for i in rows]
        vocab = logits.shape[-1]
        probs, ids = filtered_probs(
            logits[sel],
            torch.tensor([p.temperature for p in ps], device=device),
            # Clamped here, so that no top_k a request may carry overflows the tensor.
            torch.tensor([min(p.top_k, vocab) for p in ps], device=device),
            torch.tensor([p.top_p for p in ps], device=device),
        )
        # Inverse CDF with one uniform draw per row from that row's generator.
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(device)
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(-1)
        pick = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
        tokens[sel] = ids.gather(1, pick).squeeze(-1)
    return tokens.tolist()
