"""One generation request's state, as the engine sees it between steps.

A :class:`Sequence` is created by :meth:`DecoderEngine.new_sequence` and from
then on touched only by the executor thread that runs the engine: the loop
reads the :class:`~aserve.types.generation.StepOutput` values posted back,
never the sequence itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aserve.engines.decoder.detokenizer import IncrementalDetokenizer
from aserve.engines.decoder.stop import StopMatcher
from aserve.types.generation import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import llguidance


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the request's max_tokens, or the default, clamped to what fits
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's own
    # Made by the engine when the sequence starts, where the steps run (the step
    # thread, or the step process): the server's side never needs them.
    generator: torch.Generator = field(init=False, repr=False)
    detokenizer: IncrementalDetokenizer = field(init=False, repr=False)
    stop: StopMatcher = field(init=False, repr=False)
    # The matcher of the sequence's json_schema (None: free text), advanced by
    # each token it takes.
    grammar: llguidance.LLMatcher | None = field(init=False, default=None, repr=False)
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # KV-cache slot while running
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache gave it
    prefilled: int = 0  # prompt tokens whose K/V are in its slot (cached ones included)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # The last sampled token's log probability and alternatives, if asked for.
    step_logprob: TokenLogprob | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Started, its prompt not all prefilled yet (a chunked prefill)."""
        return self.slot is not None and self.prefilled < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, an end token included (as OpenAI's usage counts them)."""
        return len(self.output_ids)
