"""Chat's ``tools`` with ``tool_choice`` "required" or a named function: the call
generated under the grammar of the tools' parameters, answered as ``tool_calls``.

A request's ``tools`` (function tools: ``name``, ``description``,
``parameters`` (a JSON Schema object; none: no arguments), ``strict``) are
given to the chat template as ``tools``. With ``tool_choice``:

- ``{"type": "function", "function": {"name": N}}``: the model writes N's
  arguments, held to its ``parameters``;
- ``"required"``: the model writes ``{"name": ..., "arguments": {...}}``, held
  to one of the tools (an ``anyOf`` of each name with its parameters);
- ``"none"``: free text, the tools only shown to the template;
- ``"auto"`` (OpenAI's default when tools are given) is refused: whether to
  call a tool is the model's to say, and aserve does not parse a model's own
  tool-call format.

One call per answer (``parallel_tool_calls`` may be true or false). The
answer's message has ``content`` null and ``tool_calls`` with one call
(``id`` ``call_<hex>``, ``arguments`` the JSON text), and ``finish_reason``
``"tool_calls"``; cut short by ``max_tokens``, the generated text is the
content and the reason "length".

Frontends layer; pure checks and layout, run on the loop.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from aserve.frontends.http.openai_fields import FieldError
from aserve.frontends.http.openai_format import MAX_SCHEMA_BYTES

MAX_TOOLS = 128  # OpenAI's
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: the schema of what is generated, and how its
    text becomes a call. ``name`` None: the text is ``{"name", "arguments"}``."""

    schema: str
    name: str | None
    tools: list[dict[str, Any]]  # for the chat template, as the request gave them


def tool_plan(tools: Any, choice: Any) -> tuple[ToolPlan | None, list[dict[str, Any]] | None]:
    """The plan of a chat request's ``tools`` and ``tool_choice`` (None: free
    text), and the tools for the chat template (None when none are given);
    :class:`FieldError` names what is wrong."""
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice: is only allowed with tools")
        return None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools: must be a list of at most {MAX_TOOLS} function tools")
    params: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _function(tool, f"tools[{i}]")
        if name in params:
            raise FieldError("tools", f"tools[{i}]: the name {name!r} is given twice")
        params[name] = schema
    if choice is None or choice == "auto":
        raise FieldError(
            "tool_choice",
            "tool_choice: 'auto' (the default with tools) is not supported: give 'required', "
            "a function ({'type': 'function', 'function': {'name': ...}}) or 'none'",
        )
    if choice == "none":
        return None, tools
    if choice == "required":
        schema = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": p},
             "required": ["name", "arguments"], "additionalProperties": False}
            for n, p in params.items()
        ]}  # fmt: skip
        return ToolPlan(_text(schema), None, tools), tools
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if set(choice) != {"type", "function"} or not isinstance(name, str) or len(function) != 1:
            raise FieldError(
                "tool_choice", "tool_choice: a function is {'type': 'function', 'function': "
                "{'name': ...}}",
            )  # fmt: skip
        if name not in params:
            raise FieldError("tool_choice", f"tool_choice: no tool is named {name!r}")
        return ToolPlan(_text(params[name]), name, tools), tools
    raise FieldError(
        "tool_choice", "tool_choice: must be 'none', 'required' or {'type': 'function', "
        f"'function': {{'name': ...}}}} (got {orjson.dumps(choice).decode()[:80]})",
    )  # fmt: skip


def _function(tool: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {
        "type", "function"
    }:  # fmt: skip
        raise FieldError("tools", f"{where}: must be {{'type': 'function', 'function': {{...}}}}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise FieldError("tools", f"{where}.function: must be an object")
    unknown = sorted(str(k) for k in function if k not in _FUNCTION_KEYS)
    if unknown:
        raise FieldError("tools", f"{where}.function: unknown key {unknown[0]!r}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(
            "tools", f"{where}.function.name: must be 1 to 64 letters, digits, '_' or '-'"
        )
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise FieldError("tools", f"{where}.function.description: must be a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise FieldError("tools", f"{where}.function.strict: must be true or false")
    schema = function.get("parameters")
    if schema is None:
        return name, _NO_ARGUMENTS
    if not isinstance(schema, dict):
        raise FieldError("tools", f"{where}.function.parameters: must be a JSON Schema object")
    return name, schema


def _text(schema: dict[str, Any]) -> str:
    try:
        text = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError as exc:
        raise FieldError("tools", f"tools: a schema cannot be written as JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise FieldError(
            "tools", f"tools: the call's schema is {len(text)} bytes as JSON; at most "
            f"{MAX_SCHEMA_BYTES} are allowed",
        )  # fmt: skip
    return text


def tool_call(plan: ToolPlan, text: str) -> dict[str, Any]:
    """The call that ``text`` (a whole generation under ``plan``'s grammar) makes."""
    if plan.name is not None:
        name, arguments = plan.name, text
    else:
        doc = orjson.loads(text)
        name, arguments = doc["name"], orjson.dumps(doc["arguments"]).decode()
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
