"""OpenAI's ``response_format``: the JSON Schema (as JSON text) a request's output must match.

``{"type": "text"}`` (or null) asks for free text; ``{"type": "json_object"}``
for any JSON object; ``{"type": "json_schema", "json_schema": {"name",
"schema", "description", "strict"}}`` for a JSON value that validates
against ``schema``. The schema is compiled by the model's grammar engine when
the request is prepared (:mod:`aserve.engines.decoder.grammar`), which refuses
what it cannot enforce; here only its shape is checked. ``strict`` may be
true, false or null: the output is held to the schema either way.

Frontends layer; pure checks, run on the loop while the request is parsed.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from aserve.frontends.http.openai_fields import FieldError

PARAM = "response_format"
JSON_OBJECT = '{"type":"object"}'
MAX_SCHEMA_BYTES = 65536  # the schema's JSON text; a grammar's cost grows with it
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_KEYS = frozenset({"name", "description", "schema", "strict"})


def response_schema(value: Any) -> str | None:
    """The JSON Schema text that ``response_format`` asks the output to match,
    or None for free text; :class:`FieldError` (``param`` response_format)
    names what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError(PARAM, f"must be an object with a 'type' (got {_show(value)})")
    kind = value.get("type")
    extra = sorted(str(k) for k in value if k not in ("type", "json_schema"))
    if extra or (kind != "json_schema" and "json_schema" in value):
        key = extra[0] if extra else "json_schema"
        raise FieldError(PARAM, f"unknown key {key!r} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise FieldError(
            PARAM, f"type must be 'text', 'json_object' or 'json_schema' (got {_show(kind)})"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError(PARAM, "json_schema must be an object with a name and a schema")
    unknown = sorted(str(k) for k in spec if k not in _KEYS)
    if unknown:
        raise FieldError(PARAM, f"json_schema: unknown key {unknown[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(
            PARAM,
            f"json_schema.name must be 1 to 64 letters, digits, '_' or '-' (got {_show(name)})",
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise FieldError(PARAM, "json_schema.description must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(PARAM, f"json_schema.strict must be true or false (got {_show(strict)})")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FieldError(
            PARAM, f"json_schema.schema must be a JSON Schema object (got {_show(schema)})"
        )
    try:
        text = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError as exc:
        raise FieldError(PARAM, f"json_schema.schema cannot be written as JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise FieldError(
            PARAM,
            f"json_schema.schema is {len(text)} bytes as JSON; at most {MAX_SCHEMA_BYTES} "
            "are allowed",
        )
    return text


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
