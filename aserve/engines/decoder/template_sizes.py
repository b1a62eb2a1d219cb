"""What a chat template's operation would make, measured before it is made.

Pure functions over the values a template holds (:mod:`.chat_template` calls
them from its hooks): the size of a value as it would be written out, and a
bound on the size of what an operator, a ``str`` method or a filter would
make from its arguments, each at a cost that does not grow past ``limit``.

Runs wherever the render runs (a worker thread); no state.
"""

from __future__ import annotations

import itertools
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jinja2 import TemplateError
from markupsafe import Markup

# Integers a template may make: arithmetic on larger ones runs in one C call,
# and a 4096-bit number has 1,234 digits, more than any chat needs.
MAX_INT_BITS = 4096
INT_TOO_LARGE = -1  # what binop_size returns for integer arithmetic past MAX_INT_BITS

# What a template can hold many values in (a dict's views print all of it).
CONTAINERS = (
    list, tuple, dict, set, frozenset, type({}.keys()), type({}.values()), type({}.items())
)  # fmt: skip
SIZED = (str, bytes, *CONTAINERS)
# What escaping may make of a string given to a Markup's operator or method
# ('"' becomes '&#34;').
ESCAPE_GROWTH = 5


# What a container the template makes counts toward the total it may make, in
# characters: a slot is a pointer, and each container has a header of its own.
SLOT_CHARS = 8
CONTAINER_CHARS = 64


def value_size(value: Any, limit: int, indent: int = 0) -> int:
    """The characters ``value`` stands for when written out: a string's length; a
    container's items, one each, and theirs in turn (plus ``indent`` per level
    of depth for each item, as an indented dump writes). Stops counting once
    over ``limit``, so that it costs at most that many items."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, CONTAINERS):
        return 1 + value.bit_length() // 3 if isinstance(value, int) else 1
    return _measure(value, limit, indent)[0]


def made_size(value: Any, limit: int) -> tuple[int, int]:
    """A container's :func:`value_size`, and the characters it counts toward
    the total a render may make: its text, and :data:`SLOT_CHARS` a slot and
    :data:`CONTAINER_CHARS` a container, for it and each one it holds (one
    held twice counts twice)."""
    size, slots, containers = _measure(value, limit, 0)
    return size, size + (SLOT_CHARS - 1) * slots + CONTAINER_CHARS * containers


def _measure(value: Any, limit: int, indent: int) -> tuple[int, int, int]:
    total = slots = containers = 0
    level: list[Any] = [value]  # the containers of one depth, then of the next
    depth = 0
    while level:
        below: list[Any] = []
        per_item = 1 + (depth + 1) * indent
        for v in level:
            n = len(v)
            total += n * per_item
            slots += n
            containers += 1
            if total > limit:
                return total, slots, containers
            for x in itertools.chain(v, v.values()) if isinstance(v, dict) else v:
                t = type(x)  # the exact types first: this loop is the cost
                if t is str:
                    total += len(x)
                    if total > limit:
                        return total, slots, containers
                elif t is int:
                    total += x.bit_length() // 3
                elif t is dict or t is list or isinstance(x, CONTAINERS):
                    below.append(x)
                elif isinstance(x, (str, bytes)):
                    total += len(x)
                elif isinstance(x, int):
                    total += x.bit_length() // 3
            if total > limit:
                return total, slots, containers
        level, depth = below, depth + 1
    return total, slots, containers


def total_size(values: Iterable[Any], limit: int) -> int:
    total = 0
    for v in values:
        total += value_size(v, limit - total)
        if total > limit:
            break
    return total


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


# --- what an operation would make, before it is made ------------------------------------

# A printf-style conversion: its width and precision (digits, or "*" from the arguments).
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def percent_size(fmt: str | bytes, values: Any, limit: int) -> int:
    """A bound on the length of ``fmt % values``."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    if isinstance(values, Mapping):
        args: Iterable[Any] = values.values()
    elif isinstance(values, tuple):
        args = values
    else:
        args = (values,)
    args = list(args)
    size = len(text) + total_size(args, limit) * (ESCAPE_GROWTH if isinstance(fmt, Markup) else 1)
    for m in _PERCENT.finditer(text):
        for number in m.groups():
            if number is None:
                continue
            if number == "*":
                size += max((abs(a) for a in args if isinstance(a, int)), default=0)
            else:
                size += int(number) if len(number) <= 9 else limit + 1
        if size > limit:
            return size
    return size


def binop_size(operator: str, left: Any, right: Any, limit: int) -> int:
    if operator == "+":
        if isinstance(left, SIZED) and isinstance(right, SIZED):
            size = value_size(left, limit)
            size += size if right is left else value_size(right, limit)
            # A Markup escapes the other side.
            return size * (
                ESCAPE_GROWTH if isinstance(left, Markup) or isinstance(right, Markup) else 1
            )
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, (str, bytes, list, tuple)):
            left, right = right, left
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, int):
            return value_size(left, limit) * max(right, 0)
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                return INT_TOO_LARGE
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:
                return INT_TOO_LARGE
    elif operator == "%":
        if isinstance(left, (str, bytes)):
            return percent_size(left, right, limit)
    return 0


def method_size(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """A bound on what a call of a ``str`` or ``bytes`` method that can outgrow its
    string (or ``int.to_bytes``) makes; 0 for any other call. A Markup's methods
    are Python's, over ``str``'s, with their string arguments escaped."""
    if not isinstance(obj, (types.BuiltinMethodType, types.MethodType)):
        return 0
    s, name = obj.__self__, obj.__name__
    if isinstance(s, Markup):
        args = tuple(Markup.escape(a) if isinstance(a, str) else a for a in args)
    elif not isinstance(obj, types.BuiltinMethodType):
        return 0
    if isinstance(s, int) and name == "to_bytes":
        return _int(args[0] if args else kwargs.get("length", 1))
    if not isinstance(s, (str, bytes)):
        return 0
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _int(args[0] if args else 0))
    if name == "expandtabs":
        tab = "\t" if isinstance(s, str) else b"\t"
        tabsize = _int(args[0] if args else kwargs.get("tabsize", 8))
        return len(s) + s.count(tab) * max(tabsize, 0)
    if name == "replace" and len(args) >= 2:
        return _replace_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
    if name == "translate" and args:
        table = args[0]
        if not isinstance(table, Mapping):
            return limit + 1  # a table of unknown reach
        longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1)
        return len(s) * max(longest, 1)
    return 0


def _replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(s, (str, bytes)) and type(old) is type(s) and type(new) is type(s)):
        s, old, new = str(s), str(old), str(new)
    if len(new) <= len(old):
        return len(s)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


# --- filters -----------------------------------------------------------------------------
# Each estimate takes the size limit, then the filter's own arguments (after
# the value Jinja passes first, if any), and returns a bound on the size of
# what the filter makes.


def _center_size(limit: int, value: Any, width: Any = 80) -> int:
    return max(len(str(value)), _int(width))


def _indent_size(limit: int, s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> int:
    s = str(s)
    w = len(width) if isinstance(width, str) else _int(width)
    return len(s) + (s.count("\n") + 1) * w


def _filter_replace_size(limit: int, s: Any, old: Any, new: Any, count: Any = None) -> int:
    return _replace_size(s, old, new, count)


def _format_size(limit: int, value: Any, *args: Any, **kwargs: Any) -> int:
    return percent_size(str(value), kwargs or args, limit)


def _batch_size(limit: int, value: Any, linecount: Any, fill_with: Any = None) -> int:
    return _int(linecount)


def _slice_size(limit: int, value: Any, slices: Any, fill_with: Any = None) -> int:
    return _int(slices)


def _sum_size(limit: int, iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    if not isinstance(start, (int, float)):
        # Summing lists copies them over and over in one C call.
        raise TemplateError("sum: start must be a number in a chat template")
    return 0


def _wordwrap_size(
    limit: int,
    s: Any,
    width: Any = 79,
    break_long_words: Any = True,
    wrapstring: Any = None,
    *_: Any,
) -> int:
    s = str(s)
    lines = len(s) // max(_int(width), 1) + s.count("\n") + 1
    return len(s) + lines * len(wrapstring if isinstance(wrapstring, str) else "\n")


def _tojson_size(limit: int, value: Any, indent: Any = None) -> int:
    width = len(indent) if isinstance(indent, str) else _int(indent)
    return 6 * value_size(value, limit, indent=width)


def _pprint_size(limit: int, value: Any) -> int:
    return 2 * value_size(value, limit, indent=1)


FILTER_SIZES: dict[str, Callable[..., int]] = {
    "batch": _batch_size,
    "center": _center_size,
    "format": _format_size,
    "indent": _indent_size,
    "pprint": _pprint_size,
    "replace": _filter_replace_size,
    "slice": _slice_size,
    "sum": _sum_size,
    "tojson": _tojson_size,
    "wordwrap": _wordwrap_size,
}
# Filters whose size is also the turns of a Python loop they run (slice's).
LOOPING_FILTERS = frozenset({"slice"})
