"""Log probabilities in the OpenAI API's shapes (frontends layer; runs on the loop).

The engine gives each generated token's log probability and its top
alternatives (:data:`aserve.types.generation.TokenLogprob`, of the model's
own distribution, before temperature, penalties and biases); this module
names the tokens (each token's own text, from the model's tokenizer) and
lays them out as OpenAI does:

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``;
- completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs":
  [{token: logprob, ...}, ...], "text_offset": [...]}``, the offsets counted
  in characters of the tokens' texts from where the chunk starts.

``bytes`` are the UTF-8 of the token's text (a token that holds part of a
character has U+FFFD for it, as vLLM reports it). A request that asked for
none gets ``null``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aserve.types.generation import TokenLogprob

# Each token's own text, for a list of token ids (Generator.token_strings).
Strings = Callable[[Sequence[int]], list[str]]


def _named(
    ids: Sequence[int], logprobs: Sequence[TokenLogprob], strings: Strings
) -> tuple[list[str], list[list[tuple[str, float]]]]:
    """The tokens' texts, and each one's alternatives as (text, logprob)."""
    alternatives = [[(int(t), float(lp)) for t, lp in top] for _, top in logprobs]
    every = list(ids) + [t for top in alternatives for t, _ in top]
    texts = strings(every) if every else []
    named = texts[: len(ids)]
    at = len(ids)
    tops = []
    for top in alternatives:
        tops.append([(texts[at + j], lp) for j, (_, lp) in enumerate(top)])
        at += len(top)
    return named, tops


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(
    ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None, strings: Strings
) -> dict[str, Any] | None:
    """Chat's ``logprobs`` of these tokens (None when none were asked for)."""
    if logprobs is None:
        return None
    named, tops = _named(ids, logprobs, strings)
    content = [
        {**_entry(text, float(lp)), "top_logprobs": [_entry(t, v) for t, v in top]}
        for text, (lp, _), top in zip(named, logprobs, tops, strict=True)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None, strings: Strings, offset: int = 0
) -> dict[str, Any] | None:
    """Completions' ``logprobs`` of these tokens, their text offsets from ``offset``."""
    if logprobs is None:
        return None
    named, tops = _named(ids, logprobs, strings)
    return {
        "tokens": named,
        "token_logprobs": [float(lp) for lp, _ in logprobs],
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": list(_offsets(named, offset)),
    }


def _offsets(texts: Iterable[str], start: int) -> Iterable[int]:
    at = start
    for text in texts:
        yield at
        at += len(text)
