"""Sampling settings of a generation request: the one set of bounds, and the parser
of KServe-style request parameters (string/number/bool values).

:func:`sampling_settings` holds the bounds every route checks at the edge:
the OpenAI API (:mod:`aserve.frontends.http.openai`), Triton's generate extension
(its ``parameters`` object and top-level keys), a KServe ``/infer`` or
``ModelInfer`` on a decoder model, the requests of a decoupled
``ModelStreamInfer`` and gRPC ``Generate``. A value past a bound would
otherwise reach the engine step that a request shares with others (a
``top_k`` of 2**63 overflows the step's int64 tensor; a NaN ``temperature``
poisons its row), so it is refused here with a message naming it.

Names follow Triton's vLLM backend. Keys that are not sampling settings
(``timeout``, ``binary_data_output``, ``triton_*``...) are left to their own
readers and ignored here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from aserve.engines.decoder.sampling import SamplingParams
from aserve.errors import InvalidArgument

SAMPLING_KEYS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}
)

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
    return kw


def sampling_from_parameters(
    params: Mapping[str, Any] | None, where: str = "parameter"
) -> SamplingParams:
    """The :class:`SamplingParams` that ``params`` ask for (defaults for what is absent).

    ``where`` prefixes messages: ``parameter 'max_tokens' must be ...``.
    """
    if not params:
        return SamplingParams()
    try:
        return SamplingParams(**sampling_settings(params))
    except BadSetting as exc:
        raise InvalidArgument(f"{where} '{exc.param}' {exc.message}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where} {exc.message}") from None


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
