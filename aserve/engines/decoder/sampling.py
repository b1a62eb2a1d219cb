"""Choosing the next token from logits, per sequence.

Every sequence has its own ``torch.Generator`` and draws exactly one uniform
number per sampled token from it, so a seeded request produces the same
tokens whatever else shares its batch, and greedy rows draw nothing. The
filtering (temperature, top-k, top-p) is vectorized over the batch, and so
is what comes before it (:func:`adjust_logits`: min_tokens, logit_bias and
the penalties, in vLLM's order), for the rows that ask for any: one scatter
per kind over the tokens those rows hold, never a loop over the vocabulary.
After those, a grammar's mask (structured output,
:mod:`aserve.engines.decoder.grammar`) sets the tokens it leaves out to -inf,
and no such token is ever drawn.
The settings themselves (:class:`~aserve.types.generation.SamplingParams`)
are torch-free types the frontends build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aserve.engines.decoder.grammar import Allowed
    from aserve.engines.decoder.sequence import Sequence as EngineSequence
    from aserve.types.generation import TokenLogprob


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


def adjust_logits(logits: torch.Tensor, seqs: Sequence[EngineSequence]) -> torch.Tensor:
    """The logits (n, vocab) of ``seqs`` as their settings change them before
    sampling: end tokens out of reach until ``min_tokens``, ``logit_bias``
    added, then the repetition penalty (on the prompt's and the output's
    tokens) and the frequency and presence penalties (on the output's).
    The same tensor when no row asks for any; otherwise a float copy."""
    vocab = logits.shape[-1]
    # A grammar decides where its output ends: min_tokens does not hold that back.
    early = [
        i for i, s in enumerate(seqs)
        if len(s.output_ids) < s.params.min_tokens and s.grammar is None
    ]  # fmt: skip
    adjusted = [i for i, s in enumerate(seqs) if s.params.adjusts_logits]
    if not early and not adjusted:
        return logits
    out = logits.float().clone()
    device = out.device

    def at(rows: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)

    rows, tokens = [], []
    for i in early:
        for t in seqs[i].stop_token_ids:
            if 0 <= t < vocab:
                rows.append(i)
                tokens.append(t)
    if rows:
        out[at(rows, tokens)] = float("-inf")
    rows, tokens, biases = [], [], []
    for i in adjusted:
        for t, b in seqs[i].params.logit_bias:
            rows.append(i)
            tokens.append(t)
            biases.append(b)
    if rows:
        out.index_put_(at(rows, tokens), torch.tensor(biases, device=device), accumulate=True)
    repeat = [i for i in adjusted if seqs[i].params.repetition_penalty != 1.0]
    if repeat:
        rows, tokens = [], []
        for r, i in enumerate(repeat):
            seen = {*seqs[i].prompt_ids, *seqs[i].output_ids}
            rows.extend([r] * len(seen))
            tokens.extend(seen)
        held = torch.zeros(len(repeat), vocab, dtype=torch.bool, device=device)
        held[at(rows, tokens)] = True
        sel = torch.tensor(repeat, device=device)
        penalty = torch.tensor([seqs[i].params.repetition_penalty for i in repeat], device=device)
        sub = out[sel]
        scaled = torch.where(sub > 0, sub / penalty[:, None], sub * penalty[:, None])
        out[sel] = torch.where(held, scaled, sub)
    counted = [
        i for i in adjusted if seqs[i].params.frequency_penalty or seqs[i].params.presence_penalty
    ]
    if counted:
        rows, tokens = [], []
        for r, i in enumerate(counted):
            rows.extend([r] * len(seqs[i].output_ids))
            tokens.extend(seqs[i].output_ids)
        counts = torch.zeros(len(counted), vocab, device=device)
        if rows:
            counts.index_put_(
                at(rows, tokens), torch.ones(len(rows), device=device), accumulate=True
            )
        ps = [seqs[i].params for i in counted]
        frequency = torch.tensor([p.frequency_penalty for p in ps], device=device)
        presence = torch.tensor([p.presence_penalty for p in ps], device=device)
        sel = torch.tensor(counted, device=device)
        out[sel] -= frequency[:, None] * counts + presence[:, None] * (counts > 0).float()
    return out


def mask_logits(logits: torch.Tensor, allowed: Allowed, copy: bool) -> torch.Tensor:
    """``logits`` with the tokens each constrained row's mask leaves out at -inf
    (a float copy when ``copy``: the model's own logits stay as they came)."""
    rows, masks = allowed
    out = logits.float().clone() if copy else logits
    sel = torch.tensor(rows, device=out.device)
    width = min(out.shape[-1], masks.shape[-1])
    keep = torch.zeros(len(rows), out.shape[-1], dtype=torch.bool, device=out.device)
    keep[:, :width] = masks[:, :width].to(out.device)
    out[sel] = out[sel].masked_fill(~keep, float("-inf"))
    return out


@torch.inference_mode()
def sample(
    logits: torch.Tensor, seqs: Sequence[EngineSequence], allowed: Allowed | None = None
) -> list[int]:
    """One token per row of ``logits`` (n, vocab), by each row's sequence: its
    settings (:func:`adjust_logits` first), then its grammar's mask when
    ``allowed`` holds one for its row, and its own generator."""
    adjusted = adjust_logits(logits, seqs)
    if allowed is not None:
        adjusted = mask_logits(adjusted, allowed, copy=adjusted is logits)
    logits = adjusted
    params = [s.params for s in seqs]
    generators = [s.generator for s in seqs]
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
    if allowed is not None:
        _keep_allowed(logits, tokens, allowed)
    return tokens.tolist()


def _keep_allowed(logits: torch.Tensor, tokens: torch.Tensor, allowed: Allowed) -> None:
    """Where a constrained row drew a token its mask leaves out (the inverse
    CDF's last index, reached only by rounding), its most likely allowed one."""
    rows, masks = allowed
    sel = torch.tensor(rows, device=tokens.device)
    picked = tokens[sel].clamp(max=masks.shape[-1] - 1).cpu()
    ok = masks.gather(1, picked[:, None]).squeeze(1) & (tokens[sel].cpu() < masks.shape[-1])
    if bool(ok.all()):
        return
    bad = sel[~ok.to(sel.device)]
    tokens[bad] = logits[bad].argmax(dim=-1)


@torch.inference_mode()
def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], seqs: Sequence[EngineSequence]
) -> list[TokenLogprob | None]:
    """Each sampled token's log probability and its row's top alternatives, for
    the rows whose settings ask (``logprobs``; None for the others): one
    log-softmax and one top-k over the vocabulary for all of them, of the
    model's ``logits`` as they came."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    device = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)
    picked = torch.tensor([tokens[i] for i in rows], device=device)
    chosen = lp.gather(1, picked[:, None]).squeeze(1).tolist()
    widest = max(seqs[i].params.logprobs or 0 for i in rows)
    ids: list[list[int]] = [[] for _ in rows]
    values: list[list[float]] = [[] for _ in rows]
    if widest:
        top_values, top_ids = lp.topk(min(widest, lp.shape[-1]), dim=-1)
        ids, values = top_ids.tolist(), top_values.tolist()
    for r, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        out[i] = (chosen[r], tuple(zip(ids[r][:n], values[r][:n], strict=True)))
    return out
