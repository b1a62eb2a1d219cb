"""Incremental detokenization: token ids in, complete text pieces out.

A piece is emitted only once it decodes to whole characters: a byte-level
token that ends inside a multi-byte UTF-8 character decodes to U+FFFD, and
such text is held until a later token completes it. Decoding a short window
that starts a few tokens back (not the new token alone) keeps what depends on
context right, such as the leading space that Metaspace/SentencePiece
decoders drop at the start of a text.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one


class IncrementalDetokenizer:
    """Per sequence; ``push`` each generated token, ``flush`` when it ends."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window of ids: [_prefix, _read) was already emitted (context only),
        # [_read, end) is pending.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is pending, incomplete characters included (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        piece = text[len(done) :]
        # The window slides: what was pending becomes context for the next piece.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
