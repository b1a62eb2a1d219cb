"""What a timeout may be, and what a request's timeout parameters say, in seconds
(pure, no I/O; codecs layer).

:func:`as_timeout` is the one rule of what a timeout is: a finite positive
number. The server applies it to the ``aserve-timeout-ms`` header
(:func:`header_timeout_s`) and to the body parameters ``timeout_ms`` (aserve's spelling) and ``timeout``
(microseconds, Triton's), refusing anything else (``inf``, ``NaN``, ``0``,
``-1``, ``true``, text) with :class:`InvalidArgument` naming where it came
from; ``aserve.Batched`` applies it to its ``timeout_ms`` arguments, before
a call is queued. Which of a request's timeouts then applies is the
frontends' rule, :func:`aserve.frontends.common.resolve_deadline`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Final

from aserve.errors import InvalidArgument

# The HTTP header that asks for a request's timeout, in milliseconds.
TIMEOUT_HEADER: Final = "aserve-timeout-ms"


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


def header_timeout_s(value: str | None) -> float | None:
    """Seconds from the :data:`TIMEOUT_HEADER` header's raw value; None when it
    is absent, :class:`InvalidArgument` naming it when it is not a finite
    positive number of milliseconds."""
    if value is None:
        return None
    try:
        ms = as_timeout(float(value))
    except ValueError:
        ms = None
    if ms is None:
        shown = value[:40].encode("ascii", "backslashreplace").decode()  # junk stays one line
        raise InvalidArgument(
            f"header {TIMEOUT_HEADER}: '{shown}' must be a finite positive number of ms"
        )
    return ms / 1e3


def as_timeout(value: Any) -> float | None:
    """``value`` as a float if it is a finite number > 0, else None (``inf``, ``NaN``,
    ``0``, negatives, ``True``, anything that is not a number).

    An int of any size is finite (taken as at most ``2**1000``): the caller's cap
    (``limits.max_timeout_ms`` on the server) bounds it."""
    # bool is an int to Python, but true is no number of milliseconds. Any real
    # number counts (numpy's too: a library caller may pass np.int64(100)).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(min(value, 2**1000)) if isinstance(value, numbers.Integral) else float(value)
    return number if math.isfinite(number) and number > 0 else None


def _positive(value: Any, name: str) -> float:
    number = as_timeout(value)
    if number is None:
        raise InvalidArgument(
            f"parameter '{name}' must be a finite positive number (got {value!r})"
        )
    return number
