"""Structured output: a request's JSON Schema as a mask over the vocabulary, token by token.

The grammar engine is llguidance (``bench/RESULTS-grammar.md`` says why). A
schema (or a Lark grammar: chat's tool calls) is compiled once per model and
text (:meth:`Grammars.compile`, a bounded cache, so that the request path can
check a schema it saw before without compiling it again); each sequence that asks for one gets its own
matcher, a copy of the compiled one, made where the steps run. Each step
fills the masks of the batch's constrained sequences in one call, on a
helper thread while the model's forward runs (:meth:`Grammars.start`); the
sampler then sets every token a mask leaves out to -inf. The matcher
advances by each token the sequence takes, and the sequence ends ("stop")
when its grammar is complete.

The JSON is written compactly, with ``", "`` and ``": "`` between items and
keys and no other whitespace: a model left free to add whitespace may add it
until its tokens run out. A keyword the engine cannot enforce (``not``,
``uniqueItems``, ``if``/``then``/``else``...) is refused, never ignored: the
output always validates when the grammar completes.

Thread contract: :meth:`Grammars.compile` may be called from any thread (it
holds a lock); the matchers, :meth:`Grammars.start` and the masks belong to
the step thread.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from llguidance import TokenizerWrapper

from aserve.errors import InvalidArgument

if TYPE_CHECKING:
    from aserve.engines.decoder.sequence import Sequence as EngineSequence
    from aserve.engines.decoder.tokenizer import Tokenizer

# llguidance's JSON options: compact, exact, and what the schema's own
# "x-guidance" key asks cannot loosen them (overrides are applied last).
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# llguidance's own bounds on a grammar's size and a step's work, without its
# verbose errors: those hold the parser's state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
CACHE_SIZE = 128  # compiled schemas kept per model, least recently used dropped
MAX_MASK_THREADS = 4

Allowed = tuple[list[int], torch.Tensor]
"""The rows of a step's batch that a grammar constrains, and their masks:
bool (rows, vocab), True where a token is allowed."""


class GrammarError(InvalidArgument):
    """The request's schema is not one the grammar engine compiles; ``param`` is
    ``response_format``."""

    def __init__(self, message: str) -> None:
        super().__init__(f"response_format: {message}")
        self.param = "response_format"


class GrammarStepError(RuntimeError):
    """A sequence's matcher failed while its mask was computed (a lexer or
    parser limit): that sequence fails, the others run on."""


class Grammars:
    """One model's grammar engine: its tokenizer's tables (built at the first
    schema: about 300 ms for 49,152 tokens), the compiled schemas, the step's masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: int = 1) -> None:
        self._tokenizer = tokenizer
        # The mask covers the model's rows: a model may have more than the tokenizer's tokens.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._threads = max(1, min(threads, MAX_MASK_THREADS, os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._tables: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._helper: ThreadPoolExecutor | None = None
        self._words = (self.vocab_size + 31) // 32
        self._bits = np.zeros((0, self._words), dtype=np.int32)
        # Whether the step's masks are filled while the forward runs (the
        # bench turns it off to measure what the overlap buys).
        self.overlap = True

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tables is None:
            tok = self._tokenizer
            eos = sorted(tok.eos_token_ids) or None
            try:  # llguidance reads a byte-level tokenizer.json (GPT-2's, Llama 3's) itself
                self._tables = llguidance.LLTokenizer(
                    _plain_added_tokens(tok.inner.to_str()), n_vocab=self.vocab_size,
                    eos_token=eos,
                )  # fmt: skip
            except ValueError:  # others (SentencePiece's Metaspace): their tokens' bytes
                wrapper = TokenizerWrapper(_TokenBytes(tok, self.vocab_size))
                self._tables = llguidance.LLTokenizer(wrapper, eos_token=eos)
        return self._tables

    def is_compiled(self, schema: str) -> bool:
        """Whether ``schema`` is in the cache (then :meth:`compile` costs a lookup)."""
        return schema in self._compiled

    def compile(self, schema: str) -> llguidance.LLMatcher:
        """The compiled matcher of ``schema`` (JSON Schema text, or a grammar in
        llguidance's Lark syntax: ``SamplingParams.constraint``), from the cache
        or compiled now (about a millisecond for a schema of a few fields;
        a few hundred the first time, for the tokenizer's tables). Never
        advance it: :meth:`matcher` copies it. :class:`GrammarError` names
        what the engine refuses (a keyword it cannot enforce, a bad pattern,
        a schema over its size limits)."""
        with self._lock:
            compiled = self._compiled.get(schema)
            if compiled is not None:
                self._compiled.move_to_end(schema)
                return compiled
            if schema.startswith("{"):
                try:
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(
                        schema, overrides=JSON_OPTIONS
                    )
                except ValueError as exc:
                    raise GrammarError(f"the schema is not a JSON object: {exc}") from None
            else:  # a Lark grammar: its %json schemas carry their options in "x-guidance"
                grammar = llguidance.LLMatcher.grammar_from_lark(schema)
            compiled = llguidance.LLMatcher(
                self._llg_tokenizer(), grammar, log_level=0, limits=_LIMITS
            )
            if compiled.is_error():
                error = compiled.get_error()
                if not schema.startswith("{"):  # the first line, without where in the grammar
                    error = _LARK_WHERE.sub("", error.split("\n", 1)[0])
                raise GrammarError(_short(error))
            self._compiled[schema] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, schema: str) -> llguidance.LLMatcher:
        """A fresh matcher of ``schema`` for one sequence."""
        return self.compile(schema).deep_copy()

    # --- the step's masks (the step thread) -----------------------------------------

    def start(self, seqs: Sequence[EngineSequence]) -> PendingMasks | None:
        """Begin filling the masks of the constrained ``seqs`` (None when none is):
        on the helper thread, so that the forward runs meanwhile, unless
        ``overlap`` is off. Call :meth:`PendingMasks.wait` before sampling, and
        before the next ``start`` (the masks share one buffer)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        matchers = [seqs[i].grammar for i in rows]
        if self._bits.shape[0] < len(rows):
            self._bits = np.zeros((len(rows), self._words), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._threads)
        if not self.overlap:
            done: Future[torch.Tensor] = Future()
            done.set_result(self._fill(matchers))
            return PendingMasks(rows, matchers, done)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, "grammar-masks")
        return PendingMasks(rows, matchers, self._helper.submit(self._fill, matchers))

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The masks of ``matchers`` as bool (n, vocab); llguidance gives the GIL up
        while it fills them, so the forward's Python side runs on."""
        assert self._executor is not None
        bits = self._bits[: len(matchers)]
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bits.ctypes.data,
            self._words * 4,
            len(matchers),
        )
        # Bit j of word w is token 32 w + j (little-endian words, low bit first).
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(unpacked[:, : self.vocab_size]).bool()

    def close(self) -> None:
        """Stop the helper thread (at unload)."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None


class PendingMasks:
    """A step's masks being filled."""

    def __init__(
        self, rows: list[int], matchers: list[llguidance.LLMatcher], future: Future[torch.Tensor]
    ) -> None:
        self._rows = rows
        self._matchers = matchers
        self._future = future

    def wait(self) -> Allowed:
        """The rows and their masks; :class:`GrammarStepError` if a matcher failed."""
        masks = self._future.result()
        for m in self._matchers:
            if m.is_error():
                raise GrammarStepError(f"the grammar failed: {_short(m.get_error())}")
        return self._rows, masks

    def settle(self) -> None:
        """Wait for the fill to finish, whatever it returned (a failed step's
        cleanup: the buffer and the matchers are free for the next one)."""
        try:
            self._future.result()
        except Exception:  # the step is failing already; its own error is the one raised
            pass


class _TokenBytes:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads it: each token's
    bytes, for a tokenizer.json whose decoder llguidance does not read
    (SentencePiece's: "▁" for a space, ``<0xAB>`` for a byte). Special tokens
    get a 0xFF byte first, which no text has, so that no grammar matches them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        inner = tokenizer.inner
        special = {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            piece = inner.id_to_token(i)
            if piece is None:
                self.tokens.append(b"")
            elif i in special:
                self.tokens.append(b"\xff" + piece.encode())
            elif m := _BYTE_TOKEN.fullmatch(piece):
                self.tokens.append(bytes([int(m.group(1), 16)]))
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode())
        self.special_token_ids = sorted(special)
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self._inner = inner

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # the wrapper then sends strings
        return self._inner.encode(text, add_special_tokens=False).ids


def _plain_added_tokens(text: str) -> str:
    """A ``tokenizer.json`` with its added tokens that are not special (Qwen's
    ``<tool_call>``) moved into the BPE's vocabulary: llguidance takes every
    added token for a special one, which no grammar's text matches, so that a
    grammar asking for ``<tool_call>`` would refuse the token the model was
    trained to write it with. Only printable ASCII without spaces moves: a
    byte-level vocabulary spells those as they are."""
    doc = json.loads(text)
    vocab = doc.get("model", {}).get("vocab")
    added = doc.get("added_tokens") or []
    plain = [
        t for t in added
        if not t.get("special") and isinstance(t.get("content"), str)
        and t["content"].isascii() and t["content"].isprintable() and " " not in t["content"]
    ]  # fmt: skip
    if not plain or not isinstance(vocab, dict):
        return text
    for t in plain:
        vocab[t["content"]] = t["id"]
    doc["added_tokens"] = [t for t in added if t not in plain]
    return json.dumps(doc)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_LARK_WHERE = re.compile(r"^at \d+\(\d+\): ")


def _short(message: str, limit: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
