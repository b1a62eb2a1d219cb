"""A model's chat template, rendered at a bounded cost.

A ``chat_template`` comes from the model's folder: it is code someone else
wrote, and Jinja's sandbox keeps it from reaching the server but not from
running long (nested ``range(100000)`` loops take hours) or from making a
value of gigabytes in one C call (``'x' * 10**10``). So a template is
compiled once, at load, in an immutable sandbox that counts and checks its
work *while it runs*, and each render gets a :class:`RenderBudget` of
:class:`TemplateBounds`:

- **steps**: every turn of a ``{% for %}`` loop (each loop's iterable is
  wrapped when the template is compiled, and so is the argument of a
  recursive loop's ``loop(...)``), every call (macros included), attribute or
  item lookup, ``+ * ** %`` operator, ``~`` concatenation, comparison, filter,
  test and piece of output costs one; past ``max_steps`` the render stops.
  What goes through a container in one C or Python call of its own (``in``,
  ``==``, ``select``, ``sort``, ``list.count``, hashing a key) costs a step
  for each slot it goes through, charged before it runs, and a filter that
  takes its value item by item takes each item as a step
  (:mod:`.template_steps`).
- **time**: the clock is read at each step; past the deadline the render stops.
- **size**: a value the template makes (by an operator, a filter, a method of
  ``str``, a concatenation, a list or dict written in the template, a
  ``{% set %}`` block or a macro's text) is measured *before* it is made where
  it could outgrow what it is made of (a string's characters, a container's
  items counted deeply), and refused past ``max_chars``; all of them together,
  containers by their slots too, may come to :data:`MADE_FACTOR` x
  ``max_chars``; the output may be at most
  ``max_chars``. Integers stay under :data:`MAX_INT_BITS`.

Between two steps a template runs only a stretch of its own text once, and
each C call it makes works on values within those sizes, so a bound trips
soon after it is passed, not when the render would have ended. A tripped
bound raises :class:`TemplateLimit` (an ``InvalidArgument``: the chat is
refused with 400 naming the limit); any other failure of the template is an
``InvalidArgument`` naming it too.

Not available to templates: the ``urlize`` filter and the ``lipsum`` global
(their output has no cheap bound, and chat templates do not use them);
``namespace()`` objects print as ``<Namespace>``, without their attributes.

Runs on a worker thread (:meth:`ChatTemplate.render_threadsafe`, and the
budget's :meth:`RenderBudget.cancel` from the loop); compiling runs at load.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import math
import operator
import re
import time
import types
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Iterator as IteratorType
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError, nodes, pass_eval_context
from jinja2.ext import loopcontrols
from jinja2.filters import make_attrgetter, sync_do_join
from jinja2.runtime import LoopContext, Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer
from markupsafe import EscapeFormatter, Markup

from aserve.engines.decoder.template_sizes import (
    CONTAINERS,
    FILTER_SIZES,
    INT_TOO_LARGE,
    LOOPING_FILTERS,
    MAX_INT_BITS,
    SIZED,
    binop_size,
    made_size,
    method_size,
    total_size,
    value_size,
)
from aserve.engines.decoder.template_steps import (
    COMPARING_TESTS,
    ITEM_BY_ITEM_FILTERS,
    LOOKING_FILTERS,
    LOOKING_TESTS,
    LOOKUP_METHODS,
    SIZED_ITERABLES,
    SORTING_FILTERS,
    comparison_steps,
    containment_steps,
    slot_count,
    sorting_steps,
)
from aserve.errors import AserveError, Cancelled, InvalidArgument

if TYPE_CHECKING:
    from aserve.config import GenerationConfig

# A template is compiled to Python source about three times its size, and
# Python's compiler holds the GIL for all of it (about 50 ms at this size, on 2
# cores, while the model loads); real templates are under 20 KiB.
MAX_SOURCE_CHARS = 128 * 1024
# Everything one render makes, together, as a multiple of max_chars: a template
# rebuilds each message's text a few times (trim, concatenations) on the way out.
MADE_FACTOR = 16
# Characters of a template's own error message kept in the refusal.
_MESSAGE_CHARS = 500

# What a lookup cannot hand over more of than it holds.
_PLAIN = (str, bytes, list, tuple, dict, Namespace)
# Filters that chat templates do not use and whose output has no cheap bound.
_REMOVED_FILTERS = ("urlize",)


@dataclass(frozen=True)
class TemplateBounds:
    """What one render of a chat template may cost."""

    max_steps: int = 1_000_000
    max_chars: int = 1 << 20
    timeout_s: float = 1.0

    @classmethod
    def of(cls, gen: GenerationConfig) -> TemplateBounds:
        """The bounds a model's ``generation`` settings give."""
        return cls(
            gen.max_chat_template_steps,
            gen.chat_template_chars_limit,
            gen.chat_template_timeout_ms / 1e3,
        )


class TemplateLimit(InvalidArgument):
    """A render ran past one of its bounds; the message names the setting."""


class RenderBudget:
    """One render's allowance: made by the caller, spent by the render.

    :meth:`cancel` may be called from another thread (the loop, when the
    request goes away): the render stops at its next step.
    """

    __slots__ = ("_clock", "bounds", "cancelled", "deadline", "made_left", "steps_left")

    def __init__(self, bounds: TemplateBounds, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self._clock = clock
        self.steps_left = bounds.max_steps
        self.made_left = MADE_FACTOR * bounds.max_chars
        self.deadline = math.inf  # set when the render starts
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def start(self) -> None:
        self.deadline = self._clock() + self.bounds.timeout_s

    def spend(self, steps: int = 1) -> None:
        self.steps_left -= steps
        if self.steps_left < 0:
            raise TemplateLimit(
                f"messages: the chat template took more than {self.bounds.max_steps} steps "
                "(generation.max_chat_template_steps)"
            )
        if self._clock() > self.deadline:
            raise TemplateLimit(
                f"messages: the chat template ran for more than {self.bounds.timeout_s * 1e3:g} ms "
                "(generation.chat_template_timeout_ms)"
            )
        if self.cancelled:
            raise Cancelled("the request was cancelled while its chat template rendered")

    def allow(self, size: int) -> None:
        """Refuse to make a value of ``size`` characters or items."""
        if size > self.bounds.max_chars:
            raise TemplateLimit(
                f"messages: the chat template would make a value of {size} characters or "
                f"items, over {self.bounds.max_chars} (generation.max_chat_template_chars)"
            )

    def checked(self, value: Any) -> Any:
        """Refuse a container over the size limit (a string is left to ``made``)."""
        if isinstance(value, CONTAINERS):
            self.allow(value_size(value, self.bounds.max_chars))
        return value

    def made(self, value: Any) -> Any:
        """Check a value the template made (or was handed by a call), measured
        as it is; refuse it when it is too large. Text and
        containers count toward the total made, a container by its slots and
        what they hold (see :func:`.template_sizes.made_size`): a container
        of shared items is small, but making many of them is not."""
        if isinstance(value, SIZED):
            limit = self.bounds.max_chars
            if isinstance(value, (str, bytes)):
                size = charge = len(value)
            else:
                size, charge = made_size(value, limit)
            self.allow(size)
            self.made_left -= charge
            if self.made_left < 0:
                raise TemplateLimit(
                    f"messages: the chat template made more than {MADE_FACTOR} x "
                    f"{self.bounds.max_chars} characters in all "
                    f"({MADE_FACTOR} x generation.max_chat_template_chars)"
                )
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(
                f"messages: the chat template made an integer of more than {MAX_INT_BITS} bits"
            )
        return value

    def passes(self, values: Iterable[Any]) -> None:
        """Spend a step for each slot of the containers in ``values``: what a C
        call that goes through them (compares, hashes, copies or prints
        them) does with no step of its own in between."""
        steps = 0
        for value in values:
            steps += slot_count(value, self.steps_left - steps)
            if steps > self.steps_left:
                break
        self.spend(steps)

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable``'s items, a step each as it is taken."""
        for item in iterable:
            self.spend()
            yield item


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


class _NotRendering(Exception):
    """Jinja evaluates constant expressions while it compiles; with no render
    under way the hooks refuse, and Jinja leaves the expression to the render."""


def _budget() -> RenderBudget:
    budget = _BUDGET.get()
    if budget is None:
        raise _NotRendering
    return budget


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` counted: a step, then the slots of what it goes through (see
    :mod:`.template_steps`), then its size bound, if it has one."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
    estimate = FILTER_SIZES.get(name)
    looping = name in LOOPING_FILTERS
    looks = name in LOOKING_FILTERS
    by_item = name in ITEM_BY_ITEM_FILTERS
    sorts = name in SORTING_FILTERS

    @functools.wraps(f)  # keeps jinja_pass_arg: Jinja passes the same first argument
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        if not looks and len(args) > skip:
            value = args[skip]
            if sorts:
                # Sorting takes all the items at once: a step each, then what
                # comparing them costs.
                if isinstance(value, dict):  # dictsort's: a copy of its pairs, in C
                    pairs = list(value.items())
                    budget.spend(len(pairs))
                else:
                    value = pairs = list(budget.counted(value))
                budget.spend(sorting_steps(pairs, budget.steps_left))
                budget.passes(itertools.chain(args[skip + 1 :], kwargs.values()))
            else:
                budget.passes(itertools.chain(args[skip:], kwargs.values()))
                if by_item:
                    value = budget.counted(value)
            args = (*args[:skip], value, *args[skip + 1 :])
        if estimate is not None:
            size = estimate(budget.bounds.max_chars, *args[skip:], **kwargs)
            budget.allow(size)
            if looping:
                budget.spend(max(size, 0))
        return budget.made(f(*args, **kwargs))

    return bounded


def _bounded_test(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` counted: a step, and what the C call it makes goes through (a
    test is called once per item by ``select`` and the others)."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        own = args[skip:]
        if name in LOOKING_TESTS:
            pass
        elif name == "in" and len(own) == 2 and not kwargs:
            value, seq = own
            if isinstance(seq, IteratorType):
                seq = budget.counted(seq)
            else:
                budget.spend(containment_steps(value, seq, budget.steps_left))
            args = (*args[:skip], value, seq)
        elif name in COMPARING_TESTS and len(own) == 2 and not kwargs:
            budget.spend(comparison_steps(*own, budget.steps_left))
        else:
            budget.passes(itertools.chain(own, kwargs.values()))
        return f(*args, **kwargs)

    return bounded


# Jinja's comparison operators, by the names of its syntax tree.
_COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
}


@pass_eval_context
def _join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
    budget = _budget()
    budget.spend()
    if attribute is not None:
        value = map(make_attrgetter(eval_ctx.environment, attribute), value)
    items = list(value)
    limit = budget.bounds.max_chars
    budget.allow(total_size(items, limit) + len(str(d)) * max(len(items) - 1, 0))
    return budget.made(sync_do_join(eval_ctx, items, d))


def _tojson(value: Any, indent: int | str | None = None) -> str:
    # Templates use tojson for tool schemas; jinja2's own escapes HTML characters.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: Any) -> None:
    raise TemplateError(str(message)[:_MESSAGE_CHARS])


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """``namespace()``: its attributes, each a bounded value, may be many, so it
    prints without them (a repr of all of them would be one unbounded C call)."""

    def __repr__(self) -> str:
        return "<Namespace>"


# --- the formatter of str.format -----------------------------------------------------------


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, each field counted and the total bounded
    before the field is formatted."""

    def __init__(self, env: Any, budget: RenderBudget, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self._budget = budget
        self._total = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = self._budget
        budget.spend()
        limit = budget.bounds.max_chars
        size = value_size(value, limit)
        for number in re.findall(r"\d+", format_spec):
            size += int(number) if len(number) <= 9 else limit + 1
        self._total += size
        budget.allow(self._total)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


# --- the environment -------------------------------------------------------------------


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every hook counting a step against the render's budget."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        filters = {
            name: _bounded_filter(name, f)
            for name, f in self.filters.items()
            if name not in _REMOVED_FILTERS
        }
        filters["join"] = _join
        filters["tojson"] = _bounded_filter("tojson", _tojson)
        self.filters = filters
        self.tests = {name: _bounded_test(name, f) for name, f in self.tests.items()}
        self.globals.pop("lipsum", None)
        self.globals["namespace"] = _Namespace
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = _strftime_now
        # The text of {% set %} blocks, macros, filter and call blocks.
        self.concat = self._bounded_concat

    # Hooks of the sandbox: each is one step.

    # A lookup hands over what exists: a part of a string or container is no
    # larger than it, and a namespace attribute was measured when it was set.
    # But an object may hold many values and hand them over together (a
    # cycler's items): a container that such an object hands over is measured.

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().spend()
        value = super().getattr(obj, attribute)
        if not isinstance(obj, _PLAIN):
            _budget().checked(value)
        return value

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _budget()
        budget.spend()
        budget.passes((argument,))  # a key is hashed, and compared
        value = super().getitem(obj, argument)
        if isinstance(argument, slice):
            return budget.made(value)  # a copy
        if not isinstance(obj, _PLAIN):
            budget.checked(value)
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.spend()
        size = binop_size(operator, left, right, budget.bounds.max_chars)
        if size == INT_TOO_LARGE:
            raise TemplateLimit(
                f"messages: the chat template would make an integer of more than {MAX_INT_BITS} bits"
            )
        budget.allow(size)
        return budget.made(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        if getattr(obj, "__self__", None) is self:
            # The hooks the template was rewritten to call count for themselves.
            return super().call(context, obj, *args, **kwargs)
        if isinstance(obj, LoopContext) and args:
            # A recursive loop's loop(items): its turns count like any loop's.
            args = (self.bounded_iter(args[0]), *args[1:])
        elif isinstance(obj, types.BuiltinMethodType) and obj.__name__ == "join":
            target = obj.__self__
            if isinstance(target, (str, bytes)) and len(args) == 1:
                items = list(args[0])
                limit = budget.bounds.max_chars
                budget.allow(total_size(items, limit) + len(target) * max(len(items) - 1, 0))
                args = (items,)
        elif not isinstance(obj, Macro):  # a macro's arguments are handed over, not gone through
            budget.allow(method_size(obj, args, kwargs, budget.bounds.max_chars))
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, SIZED_ITERABLES) and obj.__name__ not in LOOKUP_METHODS:
                budget.passes((owner,))  # list.index(x), list.count(x), ...
            budget.passes(itertools.chain(args, kwargs.values()))
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(obj, Macro):
            return result  # its text was counted as it was written
        return budget.made(result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:
            return None
        f_self: str = value.__self__
        is_format_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            budget = _budget()
            formatter: _BoundedFormatter
            if isinstance(f_self, Markup):
                formatter = _BoundedEscapeFormatter(self, budget, escape=f_self.escape)
            else:
                formatter = _BoundedFormatter(self, budget)
            return budget.made(type(f_self)(formatter.vformat(f_self, args, kwargs)))

        return functools.update_wrapper(bounded, value)

    # Called from the compiled template (see _Bounds below).

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        budget = _budget()
        for item in iterable:
            budget.spend()
            yield item

    @pass_eval_context
    def concat_values(self, eval_ctx: Any, values: list[Any]) -> str:
        """``a ~ b ~ c``: measured before it is joined."""
        budget = _budget()
        budget.spend()
        budget.allow(total_size(values, budget.bounds.max_chars))
        join = markup_join if eval_ctx.autoescape else str_join
        return budget.made(join(values))

    def compare(self, left: Any, ops: tuple[str, ...], rights: list[Any]) -> bool:
        """``a == b``, ``a in b`` and the others, chained: each counted by
        what it goes through (an iterator by its items, as they are taken).
        The operands are all evaluated first, as a list; a chain stops at the
        first comparison that is false, as Python's does."""
        budget = _budget()
        budget.spend()
        for op, right in zip(ops, rights, strict=True):
            if op in ("in", "notin"):
                if isinstance(right, IteratorType):
                    right = budget.counted(right)
                else:
                    budget.spend(containment_steps(left, right, budget.steps_left))
            else:
                budget.spend(comparison_steps(left, right, budget.steps_left))
            if not _COMPARISONS[op](left, right):
                return False
            left = right
        return True

    def checked_value(self, value: Any) -> Any:
        """A list, tuple or dict written in the template with computed items."""
        budget = _budget()
        budget.spend()
        return budget.made(value)

    def _bounded_concat(self, parts: Iterable[str]) -> str:
        budget = _budget()
        parts = parts if isinstance(parts, list) else list(parts)
        budget.allow(sum(map(len, parts)))
        return budget.made("".join(parts))


class _Bounds(NodeTransformer):
    """Rewrites a parsed template so that its loops, concatenations and computed
    literals go through the environment's counting hooks."""

    def __init__(self, env: _BoundedEnvironment) -> None:
        self._env = env
        self._eval_ctx = nodes.EvalContext(env)

    def _through(self, hook: str, arg: nodes.Expr, where: nodes.Node) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(hook), [arg], [], None, None)
        return call.set_lineno(where.lineno).set_environment(self._env)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = self._through("bounded_iter", node.iter, node)
        return node

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        node = self.generic_visit(node)
        ops = nodes.Const(tuple(o.op for o in node.ops), lineno=node.lineno)
        rights = nodes.List([o.expr for o in node.ops], lineno=node.lineno)
        call = nodes.Call(
            nodes.EnvironmentAttribute("compare"), [node.expr, ops, rights], [], None, None
        )
        return call.set_lineno(node.lineno).set_environment(self._env)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return self._through("concat_values", nodes.List(node.nodes, lineno=node.lineno), node)

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":
            return node
        try:
            node.as_const(self._eval_ctx)
        except nodes.Impossible:
            return self._through("checked_value", node, node)
        return node  # made of constants: bounded by the template's own text

    visit_List = visit_Tuple = visit_Dict = _literal


_ENV = _BoundedEnvironment()


class ChatTemplate:
    """One compiled chat template. Compiling raises ``TemplateError`` when the
    source is too long or does not compile."""

    def __init__(self, source: str) -> None:
        if len(source) > MAX_SOURCE_CHARS:
            raise TemplateError(
                f"the template has {len(source)} characters, over the limit {MAX_SOURCE_CHARS}"
            )
        try:
            tree = _Bounds(_ENV).visit(_ENV.parse(source))
            self._template = _ENV.from_string(tree)
        except TemplateError:
            raise
        except Exception as exc:  # RecursionError, ValueError (a huge literal), ...
            raise TemplateError(f"{type(exc).__name__}: {exc}"[:_MESSAGE_CHARS]) from None

    def render_threadsafe(self, budget: RenderBudget, **variables: Any) -> str:
        """The template's text for ``variables``, within ``budget``.

        :class:`TemplateLimit` when a bound trips, ``Cancelled`` when the
        budget is cancelled, ``InvalidArgument`` when the template fails
        (``raise_exception`` included)."""
        token = _BUDGET.set(budget)
        budget.start()
        # The render function itself, not generate(): that adds a generator per
        # piece and rewrites tracebacks, which a refusal does not show.
        pieces = self._template.root_render_func(self._template.new_context(variables))
        try:
            out: list[str] = []
            size, limit = 0, budget.bounds.max_chars
            for piece in pieces:
                budget.spend()
                size += len(piece)
                if size > limit:
                    raise TemplateLimit(
                        f"messages: the chat template wrote more than {limit} characters "
                        "(generation.max_chat_template_chars)"
                    )
                out.append(piece)
            return "".join(out)
        except AserveError:
            raise
        except RecursionError:
            raise InvalidArgument(
                "messages: the chat template failed: it recursed too deeply"
            ) from None
        except Exception as exc:
            detail = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise InvalidArgument(
                f"messages: the chat template failed: {detail[:_MESSAGE_CHARS]}"
            ) from None
        finally:
            pieces.close()
            _BUDGET.reset(token)
