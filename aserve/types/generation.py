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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aserve.errors import InvalidArgument


class SequenceTooLong(InvalidArgument):
    """A sequence would not fit in ``max_model_len`` positions (a prompt's
    token count is checked at the edge, before the engine sees it)."""


FinishReason = Literal["stop", "length"]
""""stop": an end token or stop string; "length": max_tokens or max_model_len reached."""

TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]
"""A generated token's log probability and its most likely alternatives, most
likely first: ``(logprob, ((token_id, logprob), ...))``, of the model's own
distribution (its logits before any setting changed them)."""

MAX_LOGPROBS = 20  # top alternatives per token: OpenAI's top_logprobs bound

_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. Validation errors name the field and the value.

    ``temperature`` 0 (or below 1e-5, where dividing by it would overflow)
    is greedy, and top-k/top-p/seed then do not matter.
    ``top_k`` 0 and ``top_p`` 1 disable those filters. ``max_tokens`` None
    means the engine's default. Text equal to one of ``stop`` ends the
    sequence and is not returned; so does a token in ``stop_token_ids`` or,
    unless ``ignore_eos``, an end-of-sequence token, but not before
    ``min_tokens`` tokens (vLLM's rule).

    Before temperature and the filters, in vLLM's order: ``min_tokens``
    keeps the end tokens out of reach, ``logit_bias`` ((token id, bias)
    pairs) is added to the logits, then the penalties apply: a token of the
    prompt or of the output so far has its logit divided by
    ``repetition_penalty`` (multiplied, when negative), and one of the output
    loses ``frequency_penalty`` per time it occurs and ``presence_penalty``
    once. 1 and 0 (the defaults) leave the logits as they are.

    ``logprobs`` (None: none) asks for each generated token's log probability
    and that many alternatives (0 to :data:`MAX_LOGPROBS`), of the model's
    logits as they came, before the settings above changed them (vLLM's
    default).

    ``json_schema`` (None: free text) is a JSON Schema, as JSON text, that the
    output must match: structured output. Each token is drawn from those the
    schema's grammar allows next (after the settings above; min_tokens does
    not hold back the grammar's end), and the sequence ends ("stop") when the
    grammar is complete. Cut short by max_tokens, it ends with "length" and
    may not parse. ``grammar`` (None: none) is the same for a grammar in
    llguidance's Lark syntax (chat's tool calls, which may embed JSON Schemas
    with ``%json``); at most one of the two is given.

    These are the engine's own bounds (what its tensors and the step wire can
    carry); the narrower bounds a request is held to at the edge are
    :func:`sampling_settings`'.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    json_schema: str | None = None
    grammar: str | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"{name} must be finite (got {getattr(self, name)})")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidArgument(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if any(not (0 <= t < 2**63 and math.isfinite(b)) for t, b in self.logit_bias):
            raise InvalidArgument("logit_bias: token ids must be >= 0 and biases finite")
        if not 0 <= self.min_tokens < 2**31:
            raise InvalidArgument(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"logprobs must be from 0 to {MAX_LOGPROBS} alternatives (got {self.logprobs})"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise InvalidArgument("json_schema must be JSON text")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidArgument("grammar must be Lark text")
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidArgument("give json_schema or grammar, not both")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )

    @property
    def constraint(self) -> str | None:
        """The text the grammar engine compiles (None: free text): the JSON
        Schema, whose text is an object's (``{`` first), or the Lark grammar,
        which never starts with ``{``."""
        return self.json_schema if self.json_schema is not None else self.grammar

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits (min_tokens aside)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW


# --- the bounds every route holds a request's sampling settings to ---------------------
#
# Checked at the edge, for the OpenAI API, Triton's generate extension, KServe
# /infer and ModelInfer on a decoder model, ModelStreamInfer and gRPC Generate
# alike: a value past a bound would otherwise reach the engine step that a
# request shares with others (a top_k of 2**63 overflows the step's int64
# tensor; a NaN temperature poisons its row). Names follow Triton's vLLM
# backend. Here, beside the type, so that a route parsing a request's JSON
# calls one module for both.

SAMPLING_KEYS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"}
)  # fmt: skip

# The bounds. Integers stay within what the engine's tensors and the step
# process's wire (msgpack, 64 bits) carry; the model's own
# ``generation.max_tokens_cap`` then refuses a max_tokens it will not serve.
INT32_MAX = 2**31 - 1
MAX_TOKENS_RANGE = (1, INT32_MAX)
TOP_K_RANGE = (-1, INT32_MAX)  # -1 (vLLM) and 0: no limit
SEED_RANGE = (0, 2**64 - 1)
TEMPERATURE_RANGE = (0.0, 2.0)  # OpenAI's range; 0 is greedy
TOP_P_RANGE = (0.0, 1.0)  # open below: (0, 1]
MAX_STOP_STRINGS = 16
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence and frequency penalties
REPETITION_PENALTY_RANGE = (0.0, 2.0)  # open below: (0, 2]; 1 leaves the logits alone
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS = 1024  # entries; each costs the step a scatter
MIN_TOKENS_RANGE = (0, INT32_MAX)
MAX_STOP_CHARS = 256  # each stop string is matched against every new piece of text


class BadSetting(InvalidArgument):
    """A sampling setting is out of its bounds; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_settings(
    values: Mapping[str, Any], max_stop: int = MAX_STOP_STRINGS
) -> dict[str, Any]:
    """Keyword arguments of :class:`SamplingParams` for the settings in ``values``
    (absent or None keys are left to the defaults), each checked against its bound.

    Raises :class:`BadSetting` whose message reads after the name:
    ``must be an integer from -1 to 2147483647 (got 9223372036854775808)``.
    """
    kw: dict[str, Any] = {}
    if (v := values.get("max_tokens")) is not None:
        kw["max_tokens"] = _int(v, "max_tokens", *MAX_TOKENS_RANGE)
    if (v := values.get("temperature")) is not None:
        kw["temperature"] = _number(v, "temperature", *TEMPERATURE_RANGE)
    if (v := values.get("top_p")) is not None:
        kw["top_p"] = _number(v, "top_p", *TOP_P_RANGE, open_low=True)
    if (v := values.get("top_k")) is not None:
        kw["top_k"] = max(_int(v, "top_k", *TOP_K_RANGE), 0)  # vLLM's -1 is our 0
    if (v := values.get("seed")) is not None:
        kw["seed"] = _int(v, "seed", *SEED_RANGE)
    if (v := values.get("stop")) is not None:
        kw["stop"] = stop_strings(v, max_stop)
    if (v := values.get("ignore_eos")) is not None:
        if not isinstance(v, bool):
            raise BadSetting("ignore_eos", f"must be true or false (got {_show(v)})")
        kw["ignore_eos"] = v
    for key in ("presence_penalty", "frequency_penalty"):
        if (v := values.get(key)) is not None:
            kw[key] = _number(v, key, *PENALTY_RANGE)
    if (v := values.get("repetition_penalty")) is not None:
        kw["repetition_penalty"] = _number(
            v, "repetition_penalty", *REPETITION_PENALTY_RANGE, open_low=True
        )
    if (v := values.get("logit_bias")) is not None:
        kw["logit_bias"] = logit_bias(v)
    if (v := values.get("min_tokens")) is not None:
        kw["min_tokens"] = _int(v, "min_tokens", *MIN_TOKENS_RANGE)
        wanted = kw.get("max_tokens")
        if wanted is not None and kw["min_tokens"] > wanted:
            raise BadSetting(
                "min_tokens", f"must be at most max_tokens ({wanted}) (got {kw['min_tokens']})"
            )
    return kw


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token ids (as JSON keys, strings of
    digits) to biases from -100 to 100, at most :data:`MAX_LOGIT_BIAS` of them;
    as (id, bias) pairs in id order. Ids past the vocabulary are the engine's to
    refuse, knowing it."""
    if not isinstance(value, Mapping):
        raise BadSetting(
            "logit_bias", f"must be an object of token ids to biases (got {_show(value)})"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise BadSetting(
            "logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed"
        )
    pairs = []
    for key, bias in value.items():
        text = key if isinstance(key, str) else None
        if text is None or not text.isascii() or not text.isdigit() or len(text) > 18:
            raise BadSetting(
                "logit_bias", f"keys must be token ids, strings of digits (got {_show(key)})"
            )
        try:
            pairs.append((int(text), _number(bias, "logit_bias", *LOGIT_BIAS_RANGE)))
        except BadSetting as exc:
            raise BadSetting("logit_bias", f"for token {text}: {exc.message}") from None
    return tuple(sorted(pairs))


def stop_strings(value: Any, limit: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    """A stop string or a list of them; none may be empty or over MAX_STOP_CHARS."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadSetting("stop", f"must be a string or a list of strings (got {_show(value)})")
    if len(stops) > limit:
        raise BadSetting("stop", f"has {len(stops)} strings; at most {limit} are allowed")
    if any(not s for s in stops):
        raise BadSetting("stop", "must not hold an empty string")
    if longest := max((len(s) for s in stops if len(s) > MAX_STOP_CHARS), default=0):
        raise BadSetting(
            "stop", f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed"
        )
    return tuple(stops)


def _int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadSetting(key, f"must be an integer >= {low} and <= {high} (got {_show(value)})")
    return value


def _number(value: Any, key: str, low: float, high: float, open_low: bool = False) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        # A huge int would overflow float(); NaN and infinities fail every comparison here.
        and (not isinstance(value, int) or abs(value) <= 2**53)
        and math.isfinite(value)
        and (low < value if open_low else low <= value)
        and value <= high
    )
    if not ok:
        span = f"in ({low:g}, {high:g}]" if open_low else f"from {low:g} to {high:g}"
        raise BadSetting(key, f"must be a finite number {span} (got {_show(value)})")
    return float(value)


def _show(value: Any) -> str:
    """The offending value for a message, cut short: a client may send megabytes."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    # The token's log probability and alternatives, when the request asked for them.
    logprob: TokenLogprob | None = None
    # Prompt tokens whose K/V came from the prefix cache (not prefilled).
    cached_tokens: int = 0
    # No token: a chunk of the prompt was prefilled and more is to come (the
    # sequence stays running; its reader gets nothing from this step).
    prefilling: bool = False


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
    # One per token of ``token_ids``, when the request asked for log probabilities.
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens whose K/V came from the prefix cache (usage's cached_tokens).
    cached_tokens: int = 0
