"""Choosing the next token from logits, per sequence.

Every sequence has its own ``torch.Generator`` and draws exactly one uniform
number per sampled token from it, so a seeded request produces the same
tokens whatever else shares its batch, and greedy rows draw nothing. The
filtering (temperature, top-k, top-p) is vectorized over the batch. The
settings themselves (:class:`~aserve.types.generation.SamplingParams`) are
torch-free types the frontends build.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aserve.types.generation import SamplingParams


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
