"""What a request's timeout parameters say, in seconds (pure, no I/O; codecs layer).

A body parameter ``timeout_ms`` (aserve's spelling) or ``timeout``
(microseconds, Triton's) must be a finite positive number; anything else
(``inf``, ``NaN``, ``0``, ``-1``, ``true``, text) is refused with
:class:`InvalidArgument` naming the parameter. Which of the request's
timeouts then applies is the frontends' one rule,
:func:`aserve.frontends.common.resolve_deadline`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from aserve.errors import InvalidArgument


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
