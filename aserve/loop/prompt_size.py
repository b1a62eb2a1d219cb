"""A prompt's cost, bounded before it is paid: the one size rule of every generation route.

Tokenizing holds the GIL (so a worker thread does not keep the loop free), and
a tokenizer's output for a 30 MB prompt takes gigabytes. So a prompt is
measured from what the request declares, with work that does not grow with
it, before any per-character or per-token step:

- a text prompt by its UTF-8 bytes, against ``generation.max_prompt_bytes``
  (413);
- token ids by their count, which must leave room to generate within
  ``max_model_len`` (400);
- a chat by its number of messages, against ``generation.max_chat_messages``
  (400), then by its messages' text bytes (an assistant's tool calls'
  arguments among them) plus :data:`MESSAGE_BYTES` per message, per content
  part and per tool call (a template writes a role and markers for each),
  against the same byte limit; counting stops as soon as it is over.

The size measured is returned: it is what the prompt will cost to render and
tokenize, structure counted (:mod:`aserve.loop.runtimes.generation` decides
from it whether that work is small enough to do on the loop).

Before any of that, an HTTP generation body is refused by its size
(:func:`body_limit`) before it is parsed.

Runs on the loop; each check costs at most one pass over a bounded number of
items (``max_prompt_bytes / MESSAGE_BYTES`` for a chat).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aserve.config import GenerationConfig
from aserve.errors import InvalidArgument, TooLarge
from aserve.types.generation import SequenceTooLong

MESSAGE_BYTES = 16
# A generation request's JSON body may be this many times its model's prompt
# byte limit, plus BODY_SLACK_BYTES for the other fields: room for JSON's
# escapes (up to 6 bytes for a character) and for token ids as text. Past
# that it is refused before it is parsed: parsing holds the loop (orjson: about
# 0.2 s for 2 million token ids) and a generation body has no other bulk.
BODY_BYTES_PER_PROMPT_BYTE = 8
BODY_SLACK_BYTES = 64 * 1024


def body_limit(gen: GenerationConfig) -> int:
    """Largest JSON body of a generation request to a model with ``gen``."""
    return BODY_BYTES_PER_PROMPT_BYTE * gen.prompt_bytes_limit + BODY_SLACK_BYTES


def check_prompt_size(gen: GenerationConfig, prompt: Any = None, messages: Any = None) -> int:
    """Refuse a prompt (text, token ids, or a chat's messages; raw as decoded from
    the wire, or already parsed) that is over its limits; anything of another
    type is left to the route's own validation (and measures 0).

    Returns the size measured: a text's UTF-8 bytes, the count of token ids,
    or a chat's bytes with :data:`MESSAGE_BYTES` per message and part."""
    limit = gen.prompt_bytes_limit
    size = 0
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI's list of one prompt
    if isinstance(prompt, str):
        size = text_bytes(prompt, limit)
        if size > limit:
            raise TooLarge(
                f"prompt: at least {size} bytes, over the limit generation.max_prompt_bytes {limit}"
            )
    elif isinstance(prompt, Sequence):  # token ids
        size = len(prompt)
        if size >= gen.max_model_len:
            raise SequenceTooLong(
                f"prompt: {size} tokens leave no room to generate within "
                f"max_model_len ({gen.max_model_len})"
            )
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        if len(messages) > gen.max_chat_messages:
            raise InvalidArgument(
                f"messages: {len(messages)} messages, over the limit "
                f"generation.max_chat_messages {gen.max_chat_messages}"
            )
        size = chat_bytes(messages, limit)
        if size > limit:
            raise TooLarge(
                f"messages: {len(messages)} message(s) of at least {size} bytes, over "
                f"the limit generation.max_prompt_bytes {limit} (each message counts "
                f"{MESSAGE_BYTES} bytes besides its text)"
            )
    return size


def text_bytes(text: str, limit: int) -> int:
    """UTF-8 bytes of ``text``, or its length in characters when that alone is over
    ``limit`` (each character is at least a byte): no copy of a huge text is made."""
    if len(text) > limit:
        return len(text)
    if text.isascii():
        return len(text)
    # surrogatepass: a lone surrogate counts as its 3 bytes instead of raising here.
    return len(text.encode("utf-8", "surrogatepass"))


def chat_bytes(messages: Sequence[Any], limit: int) -> int:
    """The chat's text bytes plus MESSAGE_BYTES per message, part and tool call; stops once
    over ``limit``, so that a body of a million empty messages costs little."""
    if len(messages) * MESSAGE_BYTES > limit:
        return len(messages) * MESSAGE_BYTES
    size = 0
    for m in messages:
        size += MESSAGE_BYTES
        # A JSON object, or a gRPC ChatMessage.
        content = m.get("content") if isinstance(m, Mapping) else getattr(m, "content", None)
        if isinstance(content, str):
            size += text_bytes(content, limit)
        elif isinstance(content, list):
            for part in content:
                size += MESSAGE_BYTES
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    size += text_bytes(text, limit)
                if size > limit:
                    return size
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if isinstance(calls, list):  # an assistant's calls: their arguments are prompt text
            for call in calls:
                size += MESSAGE_BYTES
                function = call.get("function") if isinstance(call, Mapping) else None
                arguments = function.get("arguments") if isinstance(function, Mapping) else None
                if isinstance(arguments, str):
                    size += text_bytes(arguments, limit)
                if size > limit:
                    return size
        if size > limit:
            return size
    return size
