"""What a generation request asks for and what its steps produce.

Layer ``types`` (no torch, no asyncio): plain values that cross every layer, from
the frontends (which build :class:`SamplingParams`) through the continuous
batcher and the step process's wire to the engine (which makes
:class:`StepOutput` values), and back as :class:`Delta` values a stream's reader
takes from its channel. Built on the loop, read on the step thread or in the
step process, never changed after they are made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from aserve.errors import InvalidArgument

FinishReason = Literal["stop", "length"]
""""stop": an end token or stop string; "length": max_tokens or max_model_len reached."""

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

    These are the engine's own bounds (what its tensors and the step wire can
    carry); the narrower bounds a request is held to at the edge are
    :mod:`aserve.codecs.sampling`'s.
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


@dataclass(slots=True)
class Delta:
    """What a sequence produced since the reader's last read.

    ``text`` may be "" (text held back while a character or a possible stop
    string is incomplete); ``finish_reason`` is set on the last delta, and
    the token counts are the totals so far. ``finished`` (a ``finish_reason``
    is set) is a field, not a property computed per read: the stream loops of
    every route test it.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    finished: bool
