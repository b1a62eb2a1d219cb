"""A ``/v1/embeddings`` body read in OpenAI's terms, and an embedding as answered.

Pure functions over the parsed JSON and the model's ``openai.embeddings``
(:class:`aserve.config.EmbeddingsConfig`); every refusal names its field in
``param`` and the message, as the other OpenAI routes' do. ``input`` is one
of OpenAI's four forms: a string, a list of strings, a list of token ids (one
item), a list of token-id lists. Its item count and each item's size are
checked against the model's limits before anything else is done with them:
too many items is a 400, an item over its size a 413.

Frontends layer; runs on the loop, or on a thread for a large body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from aserve.codecs.timeouts import parameter_timeout_s
from aserve.config import EmbeddingsConfig
from aserve.errors import InvalidArgument, TooLarge
from aserve.frontends.http.openai_fields import FieldError, check_embedding_fields

if TYPE_CHECKING:
    from aserve.loop.runtimes.base import Runtime

ENCODINGS = ("float", "base64")
# The largest token id an integer input holds, by its datatype.
_TOKEN_MAX = {"INT32": 2**31 - 1, "INT64": 2**63 - 1}


class InputTooLarge(TooLarge):
    """An item of ``input`` over the model's size limit (413, ``param`` "input")."""

    param = "input"


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked request: its items (UTF-8 text as bytes, or token ids), as sent."""

    model: str
    config: EmbeddingsConfig
    items: list[bytes | list[int]]
    base64: bool  # encoding_format "base64": little-endian float32, as OpenAI's
    dimensions: int | None  # None: the embedding as the model makes it
    timeout_s: float | None  # aserve's timeout_ms field, if given


def embedding_config(runtime: Runtime) -> EmbeddingsConfig | None:
    """What the model declares about embedding (its ``openai.embeddings``), or
    None: it does not embed."""
    return runtime.config.openai.embeddings


def parse_embedding_request(
    body: dict[str, Any], config: EmbeddingsConfig, label: str, datatype: str, size: int
) -> EmbeddingRequest:
    """``body`` as a request to the model ``label``, whose embedding input is of
    ``datatype`` (BYTES: it takes text; INT32/INT64: token ids) and whose
    embedding has ``size`` values. Raises :class:`FieldError` (400) or
    :class:`InputTooLarge` (413)."""
    check_embedding_fields(body)
    model = body["model"]
    items = _items(body.get("input"), config, label, datatype)
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise FieldError(
            "encoding_format", f"must be 'float' or 'base64' (got {str(encoding)[:40]!r})"
        )
    dimensions = _dimensions(body.get("dimensions"), config, label, size)
    timeout_s = None
    if body.get("timeout_ms") is not None:
        try:
            timeout_s = parameter_timeout_s({"timeout_ms": body["timeout_ms"]})
        except InvalidArgument as exc:
            raise FieldError("timeout_ms", exc.message) from None
    return EmbeddingRequest(model, config, items, encoding == "base64", dimensions, timeout_s)


def _items(value: Any, config: EmbeddingsConfig, label: str, datatype: str) -> list[Any]:
    """The items of ``input``: each text as UTF-8 bytes, each token list as it was."""
    if isinstance(value, str) or (value and isinstance(value, list) and _is_int(value[0])):
        value = [value]  # one string, or one list of token ids
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else "nothing" if value is None else _kind(value)
        raise FieldError(
            "input", f"needs a string, a list of token ids, or a non-empty list of either "
            f"(got {got})",
        )  # fmt: skip
    if len(value) > config.max_inputs:
        raise FieldError(
            "input",
            f"{len(value)} items, over the limit of model '{label}' "
            f"(openai.embeddings.max_inputs {config.max_inputs})",
        )
    text = isinstance(value[0], str)
    if text and datatype != "BYTES":
        raise FieldError(
            "input",
            f"model '{label}' takes token ids only (its input '{config.input}' is {datatype}) "
            "and the server has no tokenizer of its own: send lists of token ids",
        )
    if not text and datatype == "BYTES":
        raise FieldError(
            "input",
            f"model '{label}' takes text only (its input '{config.input}' is BYTES, one "
            "string that the model tokenizes): send strings, not token ids",
        )
    return (
        [_text(v, i, config) for i, v in enumerate(value)]
        if text
        else [_tokens(v, i, config, datatype) for i, v in enumerate(value)]
    )


def _text(value: Any, i: int, config: EmbeddingsConfig) -> bytes:
    if not isinstance(value, str):
        raise FieldError("input", f"input[{i}]: a list of strings holds only strings "
                         f"(got {_kind(value)})")  # fmt: skip
    limit = config.max_input_bytes
    if len(value) > limit:  # a character is at least one byte: refused before encoding
        raise _too_large(i, f"{len(value)} characters", "max_input_bytes", limit)
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError("input", f"input[{i}]: not valid UTF-8 (a lone surrogate)") from None
    if len(data) > limit:
        raise _too_large(i, f"{len(data)} bytes", "max_input_bytes", limit)
    if not data:
        raise FieldError("input", f"input[{i}]: an empty string has no embedding")
    return data


def _tokens(value: Any, i: int, config: EmbeddingsConfig, datatype: str) -> list[int]:
    if not isinstance(value, list):
        raise FieldError("input", f"input[{i}]: a list of token-id lists holds only lists "
                         f"(got {_kind(value)})")  # fmt: skip
    if not value:
        raise FieldError("input", f"input[{i}]: an empty list of token ids has no embedding")
    limit = config.max_input_tokens
    if len(value) > limit:
        raise _too_large(i, f"{len(value)} token ids", "max_input_tokens", limit)
    for t in value:  # type(), not isinstance: true and false are not token ids
        if type(t) is not int:
            raise FieldError("input", f"input[{i}]: token ids are integers (got {_kind(t)})")
    low, high = min(value), max(value)
    if low < 0 or high > _TOKEN_MAX[datatype]:
        bad = low if low < 0 else high
        raise FieldError(
            "input",
            f"input[{i}]: token id {bad} is out of range (0 to {_TOKEN_MAX[datatype]}, "
            f"the model's {datatype} input)",
        )
    return value


def _dimensions(value: Any, config: EmbeddingsConfig, label: str, size: int) -> int | None:
    """The size asked for: None for the model's own (absent, or ``size`` itself)."""
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise FieldError("dimensions", f"must be a positive integer (got {str(value)[:40]})")
    if value == size:
        return None
    if not config.dimensions:
        raise FieldError(
            "dimensions",
            f"model '{label}' makes embeddings of {size} values only: its config's "
            f"openai.embeddings.dimensions allows no other (got {value})",
        )
    if value not in config.dimensions:
        allowed = ", ".join(str(d) for d in (*config.dimensions, size))
        raise FieldError(
            "dimensions",
            f"model '{label}' takes dimensions {allowed} (openai.embeddings.dimensions and "
            f"its own size; got {value})",
        )
    return value


def answer_vector(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The model's embedding as float32; with ``dimensions``, its first that many
    values scaled back to unit length (a zero vector stays zero)."""
    out = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        out = out[:dimensions]
        norm = float(np.linalg.norm(out))
        if norm > 0:
            out = out / np.float32(norm)
    return out


def _too_large(i: int, size: str, key: str, limit: int) -> InputTooLarge:
    return InputTooLarge(
        f"input[{i}]: {size}, over the limit openai.embeddings.{key} {limit} of the model"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__
