"""What a chat template's builtins cost in steps when they go through a container.

A step is the unit of a render's ``max_steps`` (:mod:`.chat_template`),
and the clock is read at each one. A builtin filter or test, a comparison,
or a method of Python's own that goes through a container does one C or
Python operation per item, with no hook of the sandbox in between. So what
such a pass costs is known before it runs, from its arguments alone, by the
functions here, each at a cost of its own that does not grow past the
``limit`` it is given (the steps left):

- :func:`slot_count`: the slots of the containers a value holds, counted
  deeply (a container held twice counts twice: a comparison visits it twice);
  a string or a number holds none.
- :func:`containment_steps`: ``item in seq``.
- :func:`comparison_steps`: ``left == right``, ``<`` and the others.

And which filters and tests go through their value item by item (the
value is then handed over as an iterator that spends a step per item, so
the clock is read between items), and which only look at it; any other is
charged :func:`slot_count` for each container it is given, before it runs.

Runs wherever the render runs (a worker thread); no state.
"""

from __future__ import annotations

import itertools
from typing import Any

from aserve.engines.decoder.template_sizes import CONTAINERS

# What a template can go through item by item and know the length of.
SIZED_ITERABLES = (*CONTAINERS, range)
# Where ``in`` is a hash lookup, not a pass.
_HASHED = (dict, set, frozenset, type({}.keys()), type({}.items()))

# Filters that go through their value item by item and do nothing else with
# it (it can be any iterable, and these filters treat them all alike), so it
# is handed over as a counted iterator: each item taken is a step.
ITEM_BY_ITEM_FILTERS = frozenset({
    "batch", "groupby", "join", "list", "map", "max", "min", "reject", "rejectattr",
    "select", "selectattr", "slice", "sort", "sum", "unique",
})  # fmt: skip
# Filters that sort their value: a comparison of two items each time it halves.
SORTING_FILTERS = frozenset({"dictsort", "groupby", "sort"})
# Filters that look at their value without going through it (its length, its
# first or last item, its truth) and hand over what exists.
LOOKING_FILTERS = frozenset({"attr", "count", "d", "default", "first", "last", "length", "random"})
# Tests that compare their value with their argument.
COMPARING_TESTS = frozenset({
    "!=", "<", "<=", "==", ">", ">=", "eq", "equalto", "ge", "greaterthan", "gt", "le",
    "lessthan", "lt", "ne",
})  # fmt: skip
# Tests that look at their value's type, identity or truth only.
LOOKING_TESTS = frozenset({
    "boolean", "callable", "defined", "escaped", "false", "float", "integer", "iterable",
    "mapping", "none", "number", "sameas", "sequence", "string", "true", "undefined",
})  # fmt: skip
# Methods of a container that look one thing up, or give a view of it.
LOOKUP_METHODS = frozenset({"get", "items", "keys", "values"})


def sorting_steps(items: Any, limit: int) -> int:
    """What sorting ``items`` (a list) costs: each of its slots is compared
    about once for each time the list halves."""
    steps = slot_count(items, limit)
    return steps * max(len(items), 2).bit_length() if steps <= limit else steps


def slot_count(value: Any, limit: int) -> int:
    """The slots of the containers in ``value`` (a range's numbers included),
    deeply; 0 for anything else. Stops counting once over ``limit``, so that
    it visits at most that many items."""
    if not isinstance(value, SIZED_ITERABLES):
        return 0
    total = 0
    level: list[Any] = [value]
    while level:
        below: list[Any] = []
        for v in level:
            total += len(v)
            if total > limit:
                return total
            if type(v) is range:
                continue
            for x in itertools.chain(v, v.values()) if isinstance(v, dict) else v:
                t = type(x)  # the exact types first: this loop is the cost
                if t is str or t is int:
                    continue
                if t is dict or t is list or isinstance(x, SIZED_ITERABLES):
                    below.append(x)
        level = below
    return total


def containment_steps(item: Any, seq: Any, limit: int) -> int:
    """What ``item in seq`` costs: a string's search runs in C over a value
    within the size bound, a dict or set looks ``item`` up (hashing it), and
    a list, tuple or range compares ``item`` with each of its items, each
    comparison no longer than that item's own slots. An iterator is the
    caller's to count as it is taken."""
    if isinstance(seq, (str, bytes)):
        return 0
    if isinstance(seq, _HASHED):
        return 1 + slot_count(item, limit)
    return slot_count(seq, limit)


def comparison_steps(left: Any, right: Any, limit: int) -> int:
    """What comparing ``left`` with ``right`` costs: two containers are compared
    item by item, as deep as both go; anything else in one C step."""
    if isinstance(left, SIZED_ITERABLES) and isinstance(right, SIZED_ITERABLES):
        steps = slot_count(left, limit)
        return steps + slot_count(right, limit - steps)
    return 0
