"""The OpenAI page's table of fields (docs/reference/openai.md) says what the code's
table does, row for row."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from aserve.frontends.http.openai_fields import (
    EMBEDDING_FIELDS,
    FIELDS,
    MESSAGE_FIELDS,
    Field,
    FieldError,
)
from aserve.frontends.http.openai_format import response_schema

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "openai.md"
ROW = re.compile(
    r"^\| `([a-z_\[\].]+)` \| (both|chat|completions) \| (honoured|accepted|refused): (.*?) \| (.*) \|$"
)


def _page_rows() -> dict[str, tuple[str, str, str, str]]:
    text = PAGE.read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        if m := ROW.match(line):
            name, route, kind, note, values = m.groups()
            assert name not in rows, f"{name} is listed twice"
            rows[name] = (route, kind, note, values)
    return rows


def _route(field: Field) -> str:
    return "both" if len(field.routes) == 2 else next(iter(field.routes))


def _values(cell: str) -> list[Any]:
    return [json.loads(v) for v in re.findall(r"`([^`]*)`", cell)]


def test_the_page_lists_every_field_as_the_code_treats_it() -> None:
    rows = _page_rows()
    table = {**FIELDS, **{f"messages[].{k}": f for k, f in MESSAGE_FIELDS.items()}}
    assert sorted(rows) == sorted(table)
    for name, field in table.items():
        route, kind, note, values = rows[name]
        assert (route, kind, note) == (_route(field), field.kind, field.note), name
        if field.kind == "refused":
            listed = _values(values)
            assert listed == [None, *field.nothing], name
            assert all(field.allows(v) for v in listed), name
        elif field.kind == "accepted":
            assert values == "a string, `null`" and field.allows("s") and not field.allows(1), name


def test_the_page_lists_every_embeddings_field_as_the_code_treats_it() -> None:
    rows = {}
    row = re.compile(ROW.pattern.replace("(both|chat|completions)", "(embeddings)"))
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if m := row.match(line):
            name, _, kind, note, values = m.groups()
            assert name not in rows, f"{name} is listed twice"
            rows[name] = (kind, note, values)
    assert sorted(rows) == sorted(EMBEDDING_FIELDS)
    for name, field in EMBEDDING_FIELDS.items():
        kind, note, values = rows[name]
        assert (kind, note) == (field.kind, field.note), name
        assert field.routes == {"embeddings"}, name
        if field.kind == "accepted":
            assert values == "a string, `null`" and field.allows("s") and not field.allows(1), name
        else:
            assert field.kind == "honoured" and values == "its bounds", name


def test_a_value_that_asks_for_something_is_not_taken_for_one_that_does_not() -> None:
    # JSON's false is not 0, "auto" is not "flex", and a list with more is not the empty one.
    assert not FIELDS["store"].allows(0) and FIELDS["store"].allows(False)
    assert FIELDS["service_tier"].allows("auto") and not FIELDS["service_tier"].allows("flex")
    assert not FIELDS["echo"].allows(0) and FIELDS["echo"].allows(False)
    assert FIELDS["modalities"].allows(["text"]) and not FIELDS["modalities"].allows(["audio"])
    # response_format is honoured: its own check refuses a key it does not know.
    with pytest.raises(FieldError, match="unknown key 'x'"):
        response_schema({"type": "text", "x": 1})
