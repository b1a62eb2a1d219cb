"""The reference tables the docs site generates from the code: a mkdocs hook.

``mkdocs.yml`` names this file under ``hooks:``. A page of ``docs/`` holds a
marker line, ``<!-- reference: NAME -->``, where its generated part goes;
``on_page_markdown`` replaces it at build time with:

- ``config``: every block of the JSON config, from the pydantic models of
  ``aserve/config/schema.py`` (``ServerConfig`` and every model inside it):
  each key's type, constraints, default and the text the schema documents it
  with (its attribute docstring, else its comment, else the sentences of its
  block's docstring that name it);
- ``cli``: every command of ``aserve`` and its flags, from the argparse parser
  ``aserve/cli.py`` builds (each subcommand adds its own);
- ``errors``: every error code, its exception, and its HTTP and gRPC statuses,
  from ``aserve/errors.py`` and ``aserve/frontends/status.py``.

Generated when the site is built, so the pages cannot drift from the code;
``tests/test_docs_site.py`` checks that every config key is described.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import annotated_types
from mkdocs.exceptions import PluginError
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import aserve.errors
import aserve.frontends.status
from aserve.cli import _parser as aserve_parser
from aserve.config.schema import ServerConfig
from aserve.errors import AserveError, ErrorCode
from aserve.frontends.status import STATUS

MARKER = re.compile(r"^<!-- reference: ([a-z]+) -->$", re.MULTILINE)
# Comments that direct tools, not readers.
_TOOL_COMMENT = re.compile(r"^(fmt|noqa|type|pragma):")


# --- the config schema --------------------------------------------------------------


@functools.cache
def config_models() -> dict[type[BaseModel], list[str]]:
    """Every model in ``ServerConfig``'s tree, in the order a reader meets them,
    with the JSON paths it is found at (``models[].batching``, ``devices.*``)."""
    found: dict[type[BaseModel], list[str]] = {ServerConfig: [""]}
    queue: list[type[BaseModel]] = [ServerConfig]
    while queue:
        model = queue.pop(0)
        for name, field in model.model_fields.items():
            for path, inner in _models_in(field.annotation, name):
                for base in found[model]:
                    full = f"{base}.{path}" if base else path
                    if inner not in found:
                        found[inner] = []
                        queue.append(inner)
                    if full not in found[inner]:
                        found[inner].append(full)
    return found


def _models_in(annotation: Any, path: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """The models an annotation holds, with the path suffix that reaches each."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield path, annotation
    elif origin is typing.Annotated:
        yield from _models_in(args[0], path)
    elif origin is list:
        yield from _models_in(args[0], f"{path}[]")
    elif origin is dict:
        yield from _models_in(args[1], f"{path}.*")
    elif origin in (typing.Union, types.UnionType):
        for arg in args:
            yield from _models_in(arg, path)


def anchor(model: type[BaseModel]) -> str:
    """The section anchor of ``model`` on the config page (its class name, lower case)."""
    return model.__name__.lower()


def field_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """What the schema says of each field of ``model``, as markdown; "" where it says nothing.

    A field's attribute docstring, else its comments (trailing, or the lines
    just above it), else the sentences of the class docstring that name it.
    """
    source = textwrap.dedent(inspect.getsource(model))
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    comments = _comments(source)
    class_doc = inspect.getdoc(model) or ""
    out: dict[str, str] = {}
    previous_end = body.body[0].lineno - 1 if body.body else 0
    for i, node in enumerate(body.body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            after = body.body[i + 1] if i + 1 < len(body.body) else None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                text = inspect.cleandoc(after.value.value)
            else:
                above = [comments[n] for n in range(previous_end + 1, node.lineno) if n in comments]
                own = [
                    comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments
                ]
                text = (
                    " ".join(above + own)
                    or _sentences_naming(class_doc, name)
                    or _block_summary(node.annotation)
                )
            out[name] = _markdown(text)
        previous_end = node.end_lineno or node.lineno
    return out


def _block_summary(annotation: ast.expr) -> str:
    """The first paragraph of a block's docstring, for a field whose type is that block."""
    names = [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)]
    models = [m for m in config_models() if m.__name__ in names]
    if len(models) != 1:
        return ""
    return (inspect.getdoc(models[0]) or "").split("\n\n")[0]


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of its ``#`` comment, tool directives left out."""
    found: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not _TOOL_COMMENT.match(text):
                found[tok.start[0]] = text
    return found


def _sentences_naming(doc: str, name: str) -> str:
    """The sentences of a docstring that name ``name`` as ````name````."""
    flat = " ".join(doc.split())
    sentences = re.split(r"(?<=[.])\s+(?=[A-Z`(])", flat)
    return " ".join(s for s in sentences if f"``{name}``" in s)


def _markdown(text: str) -> str:
    """reST-isms of the docstrings as markdown: ````x```` as ```x```, :class:`X` as a link."""
    text = re.sub(r":class:`~?([\w.]+)`", lambda m: _class_link(m.group(1)), text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _class_link(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    return f"[{short}](#{short.lower()})"


def type_text(annotation: Any) -> str:
    """A field's type in the words of a JSON config: integer, list of ..., one of ...."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{anchor(annotation)})"
    if origin is typing.Annotated:
        bounds = [b for meta in args[1:] for b in _constraints(meta)]
        base = type_text(args[0])
        return f"{base} ({', '.join(bounds)})" if bounds else base
    if origin is typing.Literal:
        values = ", ".join(f"`{json.dumps(v)}`" for v in args)
        return values if len(args) == 1 else f"one of {values}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"object of {type_text(args[0])} keys: {type_text(args[1])}"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", Any: "any"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _constraints(meta: Any) -> Iterator[str]:
    """What pydantic's metadata of a field bounds, as ``>= 1`` or ``matching `RE```."""
    if isinstance(meta, FieldInfo):
        for inner in meta.metadata:
            yield from _constraints(inner)
        return
    words = {
        annotated_types.Ge: (">=", "ge"),
        annotated_types.Gt: (">", "gt"),
        annotated_types.Le: ("<=", "le"),
        annotated_types.Lt: ("<", "lt"),
        annotated_types.MinLen: ("length >=", "min_length"),
        annotated_types.MaxLen: ("length <=", "max_length"),
    }
    for kind, (word, attr) in words.items():
        if isinstance(meta, kind):
            yield f"{word} {getattr(meta, attr)}"
    pattern = getattr(meta, "pattern", None)
    if isinstance(pattern, str):
        yield f"matching `{pattern}`"


def field_type(field: FieldInfo) -> str:
    bounds = [b for meta in field.metadata for b in _constraints(meta)]
    base = type_text(field.annotation)
    return f"{base} ({', '.join(bounds)})" if bounds else base


def default_text(field: FieldInfo) -> str:
    """The default as the JSON config writes it; "required" when there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return f"[its defaults](#{anchor(type(value))})"
    return f"`{json.dumps(value, default=str)}`"


def config_reference() -> str:
    """The config page's generated part: one section per model, one row per key."""
    parts: list[str] = []
    for model, paths in config_models().items():
        title = "The top level" if paths == [""] else f"`{paths[0]}`"
        parts.append(f"## {title} {{#{anchor(model)}}}\n")
        if len(paths) > 1:
            parts.append("Also at " + ", ".join(f"`{p}`" for p in paths[1:]) + ".\n")
        doc = inspect.getdoc(model) or ""
        parts.append(f"`{model.__name__}`: {_markdown(doc)}\n")
        described = field_descriptions(model)
        parts.append("| key | type | default | what it is |\n|---|---|---|---|")
        for name, field in model.model_fields.items():
            cells = (f"`{name}`", field_type(field), default_text(field), described.get(name, ""))
            parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("")
    return "\n".join(parts)


def _cell(text: str) -> str:
    """Text that stays inside one cell of a markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


# --- the command line ---------------------------------------------------------------


def cli_reference() -> str:
    """The CLI page's generated part: ``aserve``'s flags, then each command's."""
    root = aserve_parser()
    commands = _subcommands(root)
    parts = [_parser_section(root, "aserve", "aserve")]
    parts.append("| command | what it does |\n|---|---|")
    for name, (_sub, text) in commands.items():
        parts.append(f"| [`aserve {name}`](#aserve-{name}) | {_cell(text)} |")
    parts.append("")
    for name, (sub, _text) in commands.items():
        parts.append(_parser_section(sub, f"aserve {name}", f"aserve-{name}"))
    return "\n".join(parts)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def _parser_section(parser: argparse.ArgumentParser, title: str, slug: str) -> str:
    formatter = argparse.HelpFormatter(prog=parser.prog, width=72)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    usage = formatter.format_help().strip()
    parts = [f"## `{title}` {{#{slug}}}\n", f"```text\n{usage}\n```\n"]
    if parser.description:
        parts.append(parser.description + "\n")
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
        ]
        if not actions:
            continue
        parts.append(f"**{group.title}**\n")
        parts.append("| flag | value | default | what it does |\n|---|---|---|---|")
        for action in actions:
            cells = (
                _flag_text(action),
                _value_text(action),
                _default_text(action),
                formatter._expand_help(action) if action.help else "",
            )
            parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("")
    return "\n".join(parts)


def _flag_text(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    return f"`{action.metavar or action.dest}` (positional)"


def _value_text(action: argparse.Action) -> str:
    if action.option_strings and action.nargs == 0:
        return ""
    if action.choices is not None:
        return "one of " + ", ".join(f"`{c}`" for c in action.choices)
    if not action.option_strings:
        return ""
    metavar = action.metavar or action.dest.upper()
    return f"`{metavar}`" + (" (repeated)" if isinstance(action, argparse._AppendAction) else "")


def _default_text(action: argparse.Action) -> str:
    default = action.default
    if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0:
        return ""
    return f"`{default}`"


# --- the errors table ---------------------------------------------------------------


def errors_reference() -> str:
    """The errors page's generated part: one row per error code."""
    meaning = _member_comments(aserve.errors, ErrorCode.__members__)
    exceptions = {
        cls.code: cls.__name__
        for cls in vars(aserve.errors).values()
        if isinstance(cls, type) and issubclass(cls, AserveError) and cls is not AserveError
    }
    rows = ["| code | exception | HTTP | gRPC | when |", "|---|---|---|---|---|"]
    for code in ErrorCode:
        wire = STATUS[code]
        cells = (
            f"`{code.value}`",
            f"`{exceptions[code]}`",
            str(wire.http),
            f"`{wire.grpc.name}`",
            meaning.get(code.name, ""),
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _member_comments(module: types.ModuleType, names: typing.Iterable[str]) -> dict[str, str]:
    """Each enum member's trailing comment in ``module``'s source."""
    source = inspect.getsource(module)
    comments = _comments(source)
    wanted = set(names)
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in wanted and node.lineno in comments:
                out[target.id] = comments[node.lineno]
    return out


# --- the hook -----------------------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference,
    "cli": cli_reference,
    "errors": errors_reference,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: each page's ``<!-- reference: NAME -->`` line, replaced."""

    def generate(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: no generated reference named {name!r}")
        return GENERATORS[name]()

    return MARKER.sub(generate, markdown)


if __name__ == "__main__":  # one of them printed, to read without building the site
    print(GENERATORS[sys.argv[1] if len(sys.argv) > 1 else "config"]())
