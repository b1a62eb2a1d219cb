"""The ``"generation"`` block of a decoder model's config.

Lives here until ``aserve/config.py`` grows a decoder model entry; it follows
that module's conventions (frozen, unknown keys are errors, documented fields).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GenerationConfig(BaseModel):
    """Capacity and limits of one decoder engine.

    The KV cache is preallocated for ``max_num_seqs`` x ``max_model_len``
    positions per layer, so these two numbers fix the engine's memory.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] = 32
    """Sequences decoded together (KV-cache slots)."""
    max_model_len: Annotated[int, Field(ge=2)] = 2048
    """Longest sequence, prompt plus generated tokens, in tokens."""
    max_tokens_default: Annotated[int, Field(ge=1)] = 256
    """Generated tokens when a request does not say ``max_tokens``."""
    max_tokens_cap: Annotated[int, Field(ge=1)] = 4096
    """Most tokens a request may ask for; a larger ``max_tokens`` is refused."""

    @model_validator(mode="after")
    def _default_within_cap(self) -> GenerationConfig:
        if self.max_tokens_default > self.max_tokens_cap:
            raise ValueError(
                f"max_tokens_default ({self.max_tokens_default}) must be <= "
                f"max_tokens_cap ({self.max_tokens_cap})"
            )
        return self
