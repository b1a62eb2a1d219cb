"""Chat's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the calls
generated under a grammar and parsed from the answer, and tool calls in the history.

The call format is Hermes' (SmolLM2-Instruct's, Qwen2.5's, the Hermes
models'): each call is a block ``<tool_call>\\n{"name": N, "arguments":
{...}}\\n</tool_call>``, blocks one per line. The output is generated under a
grammar (llguidance's Lark, each call's JSON held to the named tool's
``parameters`` by ``%json``), so that a call the model starts always parses:

- ``"auto"`` (and no ``tool_choice`` with tools, as OpenAI): free text that
  never holds ``<tool_call>``, or text and then one or more call blocks;
- ``"required"``: one or more call blocks and nothing else;
- ``{"type": "function", "function": {"name": N}}``: one block calling N;
- ``"none"``: free text, nothing parsed.

``parallel_tool_calls`` (true by default, as OpenAI's) allows several blocks
under "auto" and "required"; false, at most one. :class:`CallReader` reads
the answer as it comes: the text before the first block is the content (its
trailing whitespace dropped; null when empty), each block a call (``id``
``call_<hex>``, ``arguments`` the JSON text); ``finish_reason`` is
``"tool_calls"`` when the answer made a call and nothing was left unfinished.
Cut short (``max_tokens``, a stop string), an unfinished block's text is
content too, with the reason as it came.

Tools reach the model one of two ways. A chat template that names ``tools``
gets them as ``tools``, and the history's calls as each assistant message's
``tool_calls`` with ``function.arguments`` an object (parsed from the JSON
text the client sent: the templates write ``arguments | tojson``, as
transformers and vLLM give them). A template that does not (the plain
default format, SmolLM2's file) gets them from :func:`render_as_text`: a
system text listing each tool as JSON and the call format, each earlier call
as its block in the assistant's content and each tool result within
``<tool_response>`` tags in its ``tool`` message.

Frontends layer; pure checks, layout and parsing, run on the loop.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from aserve.frontends.http.openai_fields import FieldError
from aserve.frontends.http.openai_format import MAX_SCHEMA_BYTES

MAX_TOOLS = 128  # OpenAI's
# The tools' JSON (names, descriptions, parameters), which a template or the
# system text writes whole: bounded before that work, on the loop.
MAX_TOOLS_BYTES = 4 * MAX_SCHEMA_BYTES
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The engine's JSON options (engines/decoder/grammar.py JSON_OPTIONS): compact
# and exact. A %json schema in a Lark grammar carries them as "x-guidance".
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# Free text without a call's start; the lazy lead ends at the first start.
_AUTO = (
    "start: TEXT | lead calls\n"
    "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
    "lead[lazy]: /(.|\\n)*<tool_call>/\n"
)
_FORCED = 'start: "<tool_call>" calls\n'
_SEVERAL = 'calls: call ("\\n<tool_call>" call)*\n'
_ONE = "calls: call\n"
# One block, from where <tool_call> was written: as the grammar writes it, or
# with any whitespace around the JSON.
_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: the grammar its answer is generated under
    (llguidance's Lark, for ``SamplingParams.grammar``)."""

    grammar: str


def tool_plan(
    tools: Any, choice: Any, parallel: Any = None
) -> tuple[ToolPlan | None, list[dict[str, Any]] | None]:
    """The plan of a chat request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` (None: free text, nothing parsed), and the tools
    for the chat template (None when none are given); :class:`FieldError`
    names what is wrong."""
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError(
            "parallel_tool_calls", f"parallel_tool_calls: must be true or false (got {parallel!r})"
        )
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice: is only allowed with tools")
        return None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools: must be a list of at most {MAX_TOOLS} function tools")
    try:
        size = len(orjson.dumps(tools))
    except orjson.JSONEncodeError as exc:
        raise FieldError("tools", f"tools: cannot be written as JSON: {exc}") from None
    if size > MAX_TOOLS_BYTES:
        raise FieldError(
            "tools", f"tools: {size} bytes as JSON; at most {MAX_TOOLS_BYTES} are allowed"
        )
    params: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _function(tool, f"tools[{i}]")
        if name in params:
            raise FieldError("tools", f"tools[{i}]: the name {name!r} is given twice")
        params[name] = schema
    several = _SEVERAL if parallel is not False else _ONE
    if choice is None or choice == "auto":
        return ToolPlan(_grammar(_AUTO + several, params)), tools
    if choice == "none":
        return None, tools
    if choice == "required":
        return ToolPlan(_grammar(_FORCED + several, params)), tools
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
        return ToolPlan(_grammar(_FORCED + _ONE, {name: params[name]})), tools
    raise FieldError(
        "tool_choice", "tool_choice: must be 'auto', 'none', 'required' or {'type': 'function', "
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


def _grammar(rules: str, params: dict[str, dict[str, Any]]) -> str:
    """The Lark grammar of ``rules`` with each call's JSON held to one of the
    tools: an ``anyOf`` of each name with its parameters (llguidance asks for
    one ``%json`` with an ``anyOf``, not an alternative of several)."""
    schema = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": p},
         "required": ["name", "arguments"], "additionalProperties": False}
        for n, p in params.items()
    ], "x-guidance": JSON_OPTIONS}  # fmt: skip
    try:
        text = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError as exc:
        raise FieldError("tools", f"tools: a schema cannot be written as JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise FieldError(
            "tools", f"tools: the calls' schema is {len(text)} bytes as JSON; at most "
            f"{MAX_SCHEMA_BYTES} are allowed",
        )  # fmt: skip
    return f'%llguidance {{}}\n{rules}call: "\\n" body "\\n</tool_call>"\nbody: %json {text}\n'


# --- the answer -------------------------------------------------------------------------


class CallReader:
    """One choice's answer read into content and calls, as it comes.

    Text is released as content at once, except what could still be the start
    of a call (a tail that ``<tool_call>`` begins with, and the whitespace
    before it); once a call has started, its text is held until its block is
    complete. A stream and a whole answer read alike, so that they agree."""

    __slots__ = ("_calling", "_from", "_held", "calls")

    def __init__(self) -> None:
        self._held = ""
        self._calling = False
        self._from = 0  # where in the held text a call's end may still be found
        self.calls = 0  # calls read so far: the next one's index

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now and the calls completed now, after ``text``."""
        held = self._held + text
        content = ""
        if not self._calling:
            at = held.find(CALL_START)
            if at < 0:
                keep = _held_from(held)
                self._held = held[keep:]
                return held[:keep], []
            content, held, self._calling = held[:at].rstrip(), held[at:], True
        calls = []
        # Each piece is searched once for a call's end: a long call costs its length.
        while (end := held.find(CALL_END, self._from)) >= 0:
            stop = end + len(CALL_END)
            m = _BLOCK.fullmatch(held, 0, stop)
            call = _call(m.group(1)) if m is not None else None
            if call is None:  # not a call (the grammar allows none): it stays text
                self._from = len(held)
                break
            calls.append(call)
            held, self._from = held[stop:], 0
        else:
            self._from = max(0, len(held) - len(CALL_END) + 1)
        self._held = held
        self.calls += len(calls)
        return content, calls

    def end(self, reason: str | None) -> tuple[str, str | None]:
        """What is left as content at the end, and the answer's finish reason."""
        left, self._held = self._held, ""
        if self._calling:
            left = left.strip()
        if self.calls and not left and reason == "stop":
            return "", "tool_calls"
        return left, reason


def _held_from(text: str) -> int:
    """Where the tail of ``text`` that could still begin a call starts: the
    longest suffix that ``<tool_call>`` starts with, and the whitespace before it."""
    cut = len(text)
    for n in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-n:]):
            cut -= n
            break
    while cut and text[cut - 1].isspace():
        cut -= 1
    return cut


def _call(body: str) -> dict[str, Any] | None:
    """The call a block's JSON makes (the grammar holds it to a tool's
    ``{"name", "arguments"}``; None if it is not one)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) or set(doc) != {
        "name", "arguments"
    }:  # fmt: skip
        return None
    name = doc["name"]
    # The arguments as the model wrote them (the grammar writes the name first).
    lead = f'{{"name": {_json(name)}, "arguments": '
    if body.startswith(lead) and body.endswith("}"):
        arguments = body[len(lead) : -1]
    else:
        arguments = orjson.dumps(doc["arguments"]).decode()
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def read_answer(
    text: str, reason: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A whole answer's content (null when a call leaves none), calls and finish reason."""
    reader = CallReader()
    content, calls = reader.push(text)
    left, reason = reader.end(reason)
    content += left
    return (content or None) if calls else content, calls, reason


# --- tool calls in the history ---------------------------------------------------------


def history_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (``where``: ``messages[3]``), checked,
    with each call's ``function.arguments`` parsed into its object;
    :class:`FieldError` (``param`` messages) names what is wrong."""
    if not isinstance(value, list):
        raise FieldError("messages", f"{where}.tool_calls: must be a list of tool calls")
    out = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or set(call) - {"id", "type", "function"}:
            raise FieldError(
                "messages", f"{at}: must be {{'id': ..., 'type': 'function', 'function': {{...}}}}"
            )
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise FieldError("messages", f"{at}.id: must be a non-empty string")
        if call.get("type", "function") != "function":
            raise FieldError("messages", f"{at}.type: must be 'function'")
        function = call.get("function")
        if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
            raise FieldError(
                "messages", f"{at}.function: must be {{'name': ..., 'arguments': ...}}"
            )
        if not isinstance(function["name"], str) or not _NAME.match(function["name"]):
            raise FieldError(
                "messages", f"{at}.function.name: must be 1 to 64 letters, digits, '_' or '-'"
            )
        arguments = function["arguments"]
        try:
            parsed = orjson.loads(arguments) if isinstance(arguments, str) else None
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise FieldError(
                "messages", f"{at}.function.arguments: must be the JSON text of an object"
            )
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": parsed}})  # fmt: skip
    return out


def check_results(messages: list[dict[str, Any]]) -> None:
    """Each ``tool`` message answers a call of an earlier assistant message."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls", ()):
            called.add(call["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise FieldError(
                "messages", f"messages[{i}].tool_call_id: {m['tool_call_id'][:80]!r} is the id "
                "of no tool call of an earlier assistant message",
            )  # fmt: skip


def render_as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, parallel: bool = True
) -> list[dict[str, Any]]:
    """The messages for a chat template that does not render tools: the tools
    and the call format in the system message (the first one's text, after a
    blank line, or a system message of their own first), each assistant's
    calls as their blocks after its content, each tool result within
    ``<tool_response>`` tags."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = "\n".join(_block(c["function"]) for c in calls)
            m["content"] = f"{m['content']}\n{blocks}" if m["content"] else blocks
        elif m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools:
        text = tools_text(tools, parallel)
        if out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def tools_text(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """The system text that lists ``tools`` and says how to call them."""
    listed = "\n".join(_json({"type": "function", "function": t["function"]}) for t in tools)
    how = ("You may call several functions, one block each, one per line." if parallel
           else "Call at most one function.")  # fmt: skip
    return (
        "# Tools\n\nYou may call functions to answer. Their signatures, one JSON object a "
        f"line, within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\nTo call a function, "
        "write a JSON object with its name and arguments within <tool_call></tool_call>:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
        f"</tool_call>\n{how} A function's result comes back within "
        "<tool_response></tool_response>."
    )


def _block(function: dict[str, Any]) -> str:
    body = _json({"name": function["name"], "arguments": function["arguments"]})
    return f"{CALL_START}\n{body}\n{CALL_END}"


def _json(value: Any) -> str:
    # The separators the grammar writes calls with: the model reads what it writes.
    return json.dumps(value, ensure_ascii=False)
