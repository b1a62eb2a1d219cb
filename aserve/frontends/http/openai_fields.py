"""Every request field of the OpenAI routes, and what aserve does with it: the one table.

A field is either **honoured** (:mod:`aserve.frontends.http.openai` reads it),
**accepted** (it names the caller and changes nothing that is generated), or
**refused unless it asks for nothing**: a value that a client sends by default
to mean "no such feature" (``n: 1``, ``store: false``, ``logprobs: false``,
``service_tier: "auto"``, null) passes; any other value is a 400
naming the field. A field the table does not know is refused as well, as
OpenAI's own API does: nothing a client sends is silently dropped. The same
holds for the keys of each chat message. The OpenAI-compatible API page
(``docs/reference/openai.md``) lists this table (``tests/test_openai_fields.py``
holds them to each other).

Frontends layer; pure checks, run on the loop before the request is parsed further.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aserve.errors import InvalidArgument

Route = Literal["chat", "completions", "embeddings"]
CHAT: frozenset[Route] = frozenset({"chat"})
COMPLETIONS: frozenset[Route] = frozenset({"completions"})
BOTH: frozenset[Route] = CHAT | COMPLETIONS
EMBEDDINGS: frozenset[Route] = frozenset({"embeddings"})


class FieldError(InvalidArgument):
    """A request field is wrong; ``param`` names it, as OpenAI's errors do."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Field:
    """What aserve does with one field, on which routes."""

    routes: frozenset[Route]
    kind: Literal["honoured", "accepted", "refused"]
    # What the field does here, or why its other values are refused.
    note: str = ""
    # Refused fields: the values besides null that ask for nothing (compared
    # with their type: true is not 1).
    nothing: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        """Whether ``value`` passes this table (an honoured field's own bounds
        are checked where it is read)."""
        if self.kind == "honoured" or value is None:
            return True
        if self.kind == "accepted":
            return isinstance(value, str)
        return any(type(value) is type(x) and value == x for x in self.nothing)


def _refused(routes: frozenset[Route], note: str, *nothing: Any) -> Field:
    return Field(routes, "refused", note, nothing)


_TOOLS = "tool calling is not supported"
_CACHE = "no prompt cache is kept"
_NAMES = "a string naming the caller; nothing generated depends on it"

FIELDS: dict[str, Field] = {
    # Read by the routes (their bounds: docs/guide/generation.md's sampling settings).
    "model": Field(BOTH, "honoured", "a model from /v1/models"),
    "messages": Field(CHAT, "honoured", "rendered with the model's chat template"),
    "prompt": Field(COMPLETIONS, "honoured", "one string or one list of token ids"),
    "max_tokens": Field(BOTH, "honoured", "at most generation.max_tokens_cap"),
    "max_completion_tokens": Field(CHAT, "honoured", "max_tokens by its newer name"),
    "temperature": Field(BOTH, "honoured", "0 to 2; 0 is greedy"),
    "top_p": Field(BOTH, "honoured", "in (0, 1]"),
    "seed": Field(BOTH, "honoured", "any int64"),
    "stop": Field(BOTH, "honoured", "up to 4 strings, not part of the text"),
    "stream": Field(BOTH, "honoured", "server-sent events (or NDJSON)"),
    "stream_options": Field(BOTH, "honoured", "include_usage; include_obfuscation false"),
    "top_k": Field(BOTH, "honoured", "vLLM's: -1 or 0 for no limit"),
    "ignore_eos": Field(BOTH, "honoured", "vLLM's"),
    "presence_penalty": Field(BOTH, "honoured", "-2 to 2, once per token in the output"),
    "frequency_penalty": Field(BOTH, "honoured", "-2 to 2, per time a token is in the output"),
    "repetition_penalty": Field(BOTH, "honoured", "vLLM's: in (0, 2], tokens of prompt and output"),
    "logit_bias": Field(BOTH, "honoured", "token id -> -100 to 100, at most 1024"),
    "min_tokens": Field(BOTH, "honoured", "vLLM's: no end token or stop string before it"),
    "n": Field(BOTH, "honoured", "1 to 128 choices, at most generation.max_num_seqs"),
    "best_of": Field(COMPLETIONS, "honoured", "n to 128 generated, the n most likely kept"),
    "logprobs": Field(BOTH, "honoured", "chat: true or false; completions: 0 to 20 alternatives"),
    "top_logprobs": Field(CHAT, "honoured", "0 to 20 alternatives, with logprobs true"),
    "priority": Field(BOTH, "honoured", "vLLM's: an integer, lower is served first"),
    "timeout_ms": Field(BOTH, "honoured", "aserve's: the request's deadline"),
    "response_format": Field(BOTH, "honoured", "text, json_object or json_schema (strict or not)"),
    "user": Field(BOTH, "accepted", _NAMES),
    "safety_identifier": Field(CHAT, "accepted", _NAMES),
    "prompt_cache_key": Field(CHAT, "accepted", "a string; " + _CACHE),
    "echo": _refused(BOTH, "echoing the prompt is not supported", False),
    "suffix": _refused(BOTH, "suffixes (insertion) are not supported", ""),
    "tools": Field(CHAT, "honoured", "function tools, called in Hermes' format under a grammar"),
    "functions": _refused(CHAT, _TOOLS, []),
    "tool_choice": Field(CHAT, "honoured", "auto (the default), none, required or a function"),
    "function_call": _refused(CHAT, _TOOLS, "none"),
    "parallel_tool_calls": Field(CHAT, "honoured", "true (the default): several calls; false: one"),
    "store": _refused(CHAT, "stored completions are not supported", False),
    "metadata": _refused(CHAT, "metadata is kept only with stored completions", {}),
    "service_tier": _refused(CHAT, "there is one service tier", "auto", "default"),
    "reasoning_effort": _refused(CHAT, "reasoning is not supported", "none"),
    "verbosity": _refused(CHAT, "verbosity is not supported"),
    "modalities": _refused(CHAT, "only text output is supported", ["text"]),
    "audio": _refused(CHAT, "audio output is not supported"),
    "prediction": _refused(CHAT, "predicted outputs are not supported"),
    "web_search_options": _refused(CHAT, "web search is not supported"),
    "moderation": _refused(CHAT, "moderation is not supported"),
    "prompt_cache_retention": _refused(CHAT, _CACHE, "in_memory"),
    "prompt_cache_options": _refused(CHAT, _CACHE),
}

# The keys of one chat message.
MESSAGE_FIELDS: dict[str, Field] = {
    "role": Field(CHAT, "honoured", "system, developer, user, assistant or tool"),
    "content": Field(CHAT, "honoured", "a string or text parts (null for an assistant)"),
    "name": Field(CHAT, "honoured", "a string given to the chat template"),
    "tool_call_id": Field(CHAT, "honoured", "a tool message's: the id of an earlier call"),
    "tool_calls": Field(CHAT, "honoured", "an assistant's calls, arguments JSON text"),
    "function_call": _refused(CHAT, "function calls in the history are not supported"),
    "refusal": _refused(CHAT, "a refusal in the history is not supported"),
    "audio": _refused(CHAT, "audio in the history is not supported"),
    "annotations": _refused(CHAT, "annotations in the history are not supported", []),
}

# The keys of stream_options (include_usage is read by the route).
STREAM_OPTIONS: dict[str, Field] = {
    "include_usage": Field(BOTH, "honoured", "a usage chunk before the end"),
    "include_obfuscation": _refused(BOTH, "obfuscation is not added", False),
}

# The fields of /v1/embeddings: a table of its own, since its model, user and
# timeout_ms rows say what they do there.
EMBEDDING_FIELDS: dict[str, Field] = {
    "model": Field(EMBEDDINGS, "honoured", "a model from /v1/models that embeds"),
    "input": Field(EMBEDDINGS, "honoured", "a string, token ids, or a list of either"),
    "encoding_format": Field(EMBEDDINGS, "honoured", "float (the default) or base64"),
    "dimensions": Field(EMBEDDINGS, "honoured", "a size the model's config allows"),
    "timeout_ms": Field(EMBEDDINGS, "honoured", "aserve's: the request's deadline"),
    "user": Field(EMBEDDINGS, "accepted", "a string naming the caller; no embedding depends on it"),
}


def check_fields(body: Mapping[str, Any], route: Route) -> None:
    """Refuse a field of ``body`` that ``route`` does not honour or accept as sent."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    for name, value in body.items():
        _check(FIELDS, route, name, value, name, name, f"field of {path}")


def check_message_fields(message: Mapping[str, Any], where: str) -> None:
    """The same for the keys of one chat message (``where``: ``messages[3]``)."""
    for name, value in message.items():
        _check(MESSAGE_FIELDS, "chat", name, value, "messages", f"{where}.{name}", "message key")


def check_stream_options(options: Mapping[str, Any], route: Route) -> None:
    """The same for the keys of ``stream_options``."""
    for name, value in options.items():
        label = f"stream_options.{name}"
        _check(STREAM_OPTIONS, route, name, value, "stream_options", label, "key")


def _check(
    table: Mapping[str, Field], route: Route, name: Any, value: Any, param: str, label: str,
    what: str,
) -> None:  # fmt: skip
    rule = table.get(name) if isinstance(name, str) else None
    if rule is None or route not in rule.routes:
        raise FieldError(param, f"{label}: unknown {what} (refused rather than ignored)")
    if not rule.allows(value):
        # reprlib: a few items of a long value, at a cost that does not grow with it.
        raise FieldError(param, f"{label}: {rule.note} (got {reprlib.repr(value)})")


def check_embedding_fields(body: Mapping[str, Any]) -> None:
    """Refuse a field of a ``/v1/embeddings`` body that its table does not honour or accept."""
    for name, value in body.items():
        _check(EMBEDDING_FIELDS, "embeddings", name, value, name, name, "field of /v1/embeddings")
