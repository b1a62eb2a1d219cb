"""The model's tokenizer (``tokenizer.json``), its end tokens and chat template.

End-of-sequence ids are the union of what ``config.json``,
``generation_config.json`` and the tokenizer's ``eos_token`` declare: models
often list a chat turn's end token in only one of them.

Chat formatting uses the model's Jinja ``chat_template`` (from
``tokenizer_config.json`` or a ``chat_template.jinja`` file beside it) in a
sandbox that bounds its cost (:mod:`aserve.engines.decoder.chat_template`).
A model without one gets :data:`DEFAULT_CHAT_FORMAT`: each message
as ``role: content`` on its own line, then ``assistant:`` when a generation
prompt is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError

from aserve.config.schema import CheckpointLimits
from aserve.engines.decoder.chat_template import ChatTemplate, RenderBudget, TemplateBounds
from aserve.engines.decoder.checkpoint import read_bounded, read_json
from aserve.engines.decoder.detokenizer import IncrementalDetokenizer
from aserve.engines.decoder.spec import CheckpointError
from aserve.errors import InvalidArgument

DEFAULT_CHAT_FORMAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Tokenizer:
    """Encoding, decoding and chat formatting for one model."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        eos_token_ids: Iterable[int] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.inner = inner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.has_chat_template = chat_template is not None
        # A template that never names `tools` renders neither them nor calls:
        # the OpenAI route then writes them into the messages itself.
        self.template_reads_tools = chat_template is not None and "tools" in chat_template
        # Compiled once: a broken template fails at load, not on the first request.
        self._template = ChatTemplate(chat_template or DEFAULT_CHAT_FORMAT)

    @classmethod
    def load(cls, folder: str | Path, limits: CheckpointLimits | None = None) -> Tokenizer:
        """The folder's tokenizer. Each file's size is checked against
        ``limits`` before it is read: ``tokenizers`` holds the GIL while it
        builds a tokenizer (the event loop waits, even when this runs on a
        thread), for a time that grows with ``tokenizer.json``'s size."""
        folder = Path(folder)
        limits = limits or CheckpointLimits()
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder}: no tokenizer.json")
        raw = read_bounded(path, limits.max_tokenizer_bytes, "max_tokenizer_bytes")
        try:
            inner = tokenizers.Tokenizer.from_buffer(raw)
        except Exception as exc:  # the Rust side raises plain Exception
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from None
        del raw
        # A prompt is encoded as it is: padding would add tokens (a file's fixed
        # padding of millions would be allocated per request) and truncation
        # would cut it silently instead of refusing it by max_model_len.
        inner.no_padding()
        inner.no_truncation()
        tok_config = _optional_json(folder / "tokenizer_config.json", limits)
        bos = _token_text(tok_config.get("bos_token"))
        eos = _token_text(tok_config.get("eos_token"))
        eos_ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos_ids |= _ids(_optional_json(folder / name, limits).get("eos_token_id"))
        if eos is not None and (eos_id := inner.token_to_id(eos)) is not None:
            eos_ids.add(eos_id)
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            raw_template = read_bounded(
                jinja_file, limits.max_config_file_bytes, "max_config_file_bytes"
            )
            template = raw_template.decode("utf-8")
        try:
            return cls(inner, eos_ids, bos, eos, template if isinstance(template, str) else None)
        except TemplateError as exc:
            raise CheckpointError(f"{folder}: chat_template does not compile: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, release_gil: bool = False
    ) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the
        tokenizer's post-processor adds (e.g. Llama's BOS).

        ``release_gil``: for a worker thread. ``tokenizers``' ``encode`` holds
        the GIL for the whole text (the event loop then stalls as if it ran
        on the loop); ``encode_batch`` gives it up while the Rust side works.
        """
        if release_gil:
            (encoding,) = self.inner.encode_batch([text], add_special_tokens=add_special_tokens)
            return encoding.ids
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.inner, prompt_ids)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        budget: RenderBudget | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a chat; encode it with ``add_special_tokens=False``
        (templates write their own BOS). :class:`InvalidArgument` when the
        template rejects the messages, or runs past ``budget`` (default:
        :class:`TemplateBounds`'s defaults); a model's own template runs as
        long as its budget lets it, so call this on a worker thread."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise InvalidArgument(f"messages[{i}]: a message needs a 'role'")
        return self._template.render_threadsafe(
            budget or RenderBudget(TemplateBounds()),
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _optional_json(path: Path, limits: CheckpointLimits) -> dict[str, Any]:
    return read_json(path, limits) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """``eos_token`` is a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()
