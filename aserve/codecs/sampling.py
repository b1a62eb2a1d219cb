"""Sampling settings from KServe-style request parameters (string/number/bool values).

Used wherever a generation request arrives with a flat ``parameters`` map:
Triton's generate extension (its ``parameters`` object and top-level keys),
a KServe ``/infer`` or ``ModelInfer`` on a decoder model, and the requests of
a decoupled ``ModelStreamInfer``. Names follow Triton's vLLM backend. Keys
that are not sampling settings (``timeout``, ``binary_data_output``,
``triton_*``...) are left to their own readers and ignored here. Every error
names the parameter and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aserve.engines.decoder.sampling import SamplingParams
from aserve.errors import InvalidArgument

SAMPLING_KEYS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}
)


def sampling_from_parameters(
    params: Mapping[str, Any] | None, where: str = "parameter"
) -> SamplingParams:
    """The :class:`SamplingParams` that ``params`` ask for (defaults for what is absent).

    ``where`` prefixes messages: ``parameter 'max_tokens': ...``.
    """
    if not params:
        return SamplingParams()
    kw: dict[str, Any] = {}
    if (v := params.get("max_tokens")) is not None:
        kw["max_tokens"] = _int(v, "max_tokens", where, minimum=1)
    if (v := params.get("temperature")) is not None:
        kw["temperature"] = _number(v, "temperature", where)
    if (v := params.get("top_p")) is not None:
        kw["top_p"] = _number(v, "top_p", where)
    if (v := params.get("top_k")) is not None:
        # vLLM spells "no limit" -1; ours is 0.
        k = _int(v, "top_k", where, minimum=-1)
        kw["top_k"] = 0 if k == -1 else k
    if (v := params.get("seed")) is not None:
        kw["seed"] = _int(v, "seed", where, minimum=0)
    if (v := params.get("stop")) is not None:
        kw["stop"] = stop_strings(v, f"{where} 'stop'")
    if (v := params.get("ignore_eos")) is not None:
        if not isinstance(v, bool):
            raise InvalidArgument(f"{where} 'ignore_eos' must be true or false (got {v!r})")
        kw["ignore_eos"] = v
    try:
        return SamplingParams(**kw)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where} {exc.message}") from None


def stop_strings(value: Any, name: str, limit: int = 16) -> tuple[str, ...]:
    """A stop string or a list of them; none may be empty."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"{name} must be a string or a list of strings (got {value!r})")
    if len(stops) > limit:
        raise InvalidArgument(f"{name} has {len(stops)} strings; at most {limit} are allowed")
    if any(not s for s in stops):
        raise InvalidArgument(f"{name}: a stop string must not be empty")
    return tuple(stops)


def _int(value: Any, key: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{where} '{key}' must be an integer >= {minimum} (got {value!r})")
    return value


def _number(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{where} '{key}' must be a number (got {value!r})")
    return float(value)
