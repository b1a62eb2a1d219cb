"""One generation request's state, as the engine sees it between steps.

A :class:`Sequence` is created by :meth:`DecoderEngine.new_sequence` and from
then on touched only by the executor thread that runs the engine: the loop
reads the :class:`StepOutput` values posted back, never the sequence itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from aserve.engines.decoder.detokenizer import IncrementalDetokenizer
from aserve.engines.decoder.sampling import SamplingParams
from aserve.engines.decoder.stop import StopMatcher

FinishReason = Literal["stop", "length"]
""""stop": an end token or stop string; "length": max_tokens or max_model_len reached."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the request's max_tokens, or the default, clamped to what fits
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's own
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # KV-cache slot while running
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one sequence.

    ``text`` is the newly complete text (possibly "" while a character or a
    possible stop string is held back); once ``finished``, everything held
    has been released and the sequence's slot is free. The token counts are
    the totals so far, for usage reports. A member that failed on its own has
    ``error`` set (and ``finished``, with no ``finish_reason``).
    """

    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    # Set when this sequence alone failed the step (its slot is free, it is
    # finished); the other sequences of the step went on. ``error_code`` is an
    # :class:`aserve.errors.ErrorCode` value.
    error: str | None = None
    error_code: str = "internal"
