"""The one deadline rule, for every route of both frontends (pure, no I/O).

A request may ask for a timeout three ways: the ``aserve-timeout-ms`` header
(HTTP), a body parameter (``timeout_ms``, or Triton's ``timeout`` in
microseconds), and the gRPC call's deadline. Its timeout is the earliest of
those it gives, or the model's default when it gives none; either way no
later than ``limits.max_timeout_ms``. A given value that is not a finite
positive number (``inf``, ``NaN``, ``1e309``, ``0``, ``-1``, text) is refused
with :class:`InvalidArgument` naming the field: "no deadline" is not a
deadline, and a request nobody bounds would hold its queue slot forever.

Frontends parse what they got with :func:`header_timeout_s` and
:func:`parameter_timeout_s`, then call :func:`request_timeout_s` once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from aserve.errors import InvalidArgument

TIMEOUT_HEADER = "aserve-timeout-ms"


def header_timeout_s(value: str | None) -> float | None:
    """Seconds from an ``aserve-timeout-ms`` header value (milliseconds), if given."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        shown = value[:40].encode("ascii", "backslashreplace").decode()  # junk stays one line
        raise InvalidArgument(
            f"header {TIMEOUT_HEADER}: '{shown}' must be a finite positive number of ms"
        )
    return ms / 1e3


def parameter_timeout_s(params: Mapping[str, Any] | None) -> float | None:
    """Seconds from the request parameters ``timeout_ms`` and ``timeout`` (µs),
    the earlier of the two when both are given; None when neither is."""
    if not params:
        return None
    asked = []
    if "timeout_ms" in params:
        asked.append(_positive(params["timeout_ms"], "timeout_ms") / 1e3)
    if "timeout" in params:
        asked.append(_positive(params["timeout"], "timeout") / 1e6)
    return min(asked, default=None)


def request_timeout_s(asked: tuple[float | None, ...], default_s: float, max_s: float) -> float:
    """The request's timeout: the earliest of ``asked`` (None: not given), else
    ``default_s``; at most ``max_s`` (``limits.max_timeout_ms``) either way.

    ``asked`` holds what the parsers above returned and the gRPC call's
    ``time_remaining()`` (None without a deadline; it may be <= 0 once passed,
    which the batcher then answers DEADLINE_EXCEEDED).
    """
    given = [t for t in asked if t is not None]
    timeout = min(given) if given else default_s
    return min(timeout, max_s)


def _positive(value: Any, name: str) -> float:
    # bool is an int to Python, but true is no number of milliseconds.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        number = math.nan
    elif isinstance(value, int):
        number = float(min(value, 2**1000))  # finite, however large: the cap bounds it
    else:
        number = value
    if not (math.isfinite(number) and number > 0):
        raise InvalidArgument(
            f"parameter '{name}' must be a finite positive number (got {value!r})"
        )
    return number
