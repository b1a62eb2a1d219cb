"""Structured output over the OpenAI API on a real server (the openai SDK and
LangChain against the tiny decoders, their steps in a step process): a random
model's output, held to a JSON Schema by the grammar's masks, always parses and
validates when it ends with "stop"; streamed equals whole; a schema the engine
cannot enforce is refused by name; max_tokens cuts it short with "length"."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import jsonschema
import openai
import pytest
from conftest import ServerProcess
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "An order, please"}]
SEEDS = range(4)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Item(BaseModel):
    name: str = Field(max_length=4)
    qty: int = Field(ge=0, le=9)


class Order(BaseModel):
    color: Color
    items: list[Item] = Field(min_length=1, max_length=2)
    urgent: bool


SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["alpha", "beta", 3, None]},
    "array with bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-C]{2}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def _format(schema: dict[str, Any], strict: bool | None = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}


def test_parse_with_a_pydantic_model_gives_a_valid_model(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        answer = client.chat.completions.parse(
            model="gpt2", messages=MESSAGES, response_format=Order, max_tokens=110, seed=seed,
            temperature=1.0,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice.message.content
        parsed = choice.message.parsed
        assert isinstance(parsed, Order)
        assert Order.model_validate_json(choice.message.content) == parsed
    # Greedy too.
    answer = client.chat.completions.parse(
        model="gpt2", messages=MESSAGES, response_format=Order, max_tokens=110, temperature=0
    )
    assert isinstance(answer.choices[0].message.parsed, Order)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_each_schema_validates_on_both_routes(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    for seed in SEEDS:
        chat = client.chat.completions.create(
            model="gpt2", messages=MESSAGES, response_format=_format(schema, strict=seed % 2 == 0),
            max_tokens=100, seed=seed, extra_body={"top_k": 50},
        )  # fmt: skip
        done = client.completions.create(
            model="gpt2", prompt="Data:", max_tokens=100, seed=seed,
            extra_body={"response_format": _format(schema, strict=None)},
        )  # fmt: skip
        for reason, text in (
            (chat.choices[0].finish_reason, chat.choices[0].message.content),
            (done.choices[0].finish_reason, done.choices[0].text),
        ):
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_a_json_object(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        answer = client.chat.completions.create(
            model="gpt2", messages=MESSAGES, response_format={"type": "json_object"},
            max_tokens=110, seed=seed,
            # A random model nests and writes long strings: close them sooner.
            logit_bias=_bias(client, '"}'),
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def _bias(client: openai.OpenAI, chars: str) -> dict[str, int]:
    """A bias towards the tokens of ``chars``, for the tiny gpt2's byte tokens."""
    import tokenizers

    from aserve.engines.decoder.tiny import byte_level_tokenizer

    tok: tokenizers.Tokenizer = byte_level_tokenizer(400)
    return {str(tok.token_to_id(c) or tok.encode(c).ids[0]): 5 for c in chars}


def test_text_format_and_null_leave_the_output_free(client: openai.OpenAI) -> None:
    args = {"model": "gpt2", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**args)
    for fmt in ({"type": "text"}, None):
        again = client.chat.completions.create(**args, extra_body={"response_format": fmt})
        assert again.choices[0].message.content == plain.choices[0].message.content


def test_a_streamed_answer_equals_the_whole_one(client: openai.OpenAI) -> None:
    args = {"model": "gpt2", "messages": MESSAGES, "max_tokens": 110, "seed": 7,
            "response_format": _format(Order.model_json_schema())}  # fmt: skip
    whole = client.chat.completions.create(**args)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason == "stop"
    Order.model_validate_json(whole.choices[0].message.content)
    done = {"model": "gpt2", "prompt": "x", "max_tokens": 100, "seed": 3,
            "extra_body": {"response_format": _format(SCHEMAS["nested"])}}  # fmt: skip
    text = client.completions.create(**done).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**done, stream=True))
    assert streamed == text
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_every_choice_is_held_to_the_schema(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="gpt2", messages=MESSAGES, n=3, seed=11, max_tokens=100,
        response_format=_format(SCHEMAS["array with bounds"]),
    )  # fmt: skip
    assert len(answer.choices) == 3
    for c in answer.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["array with bounds"])


def test_max_tokens_cuts_the_output_short_with_length(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="gpt2", messages=MESSAGES, max_tokens=3, seed=1,
        response_format=_format(Order.model_json_schema()),
    )  # fmt: skip
    [choice] = answer.choices
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 3
    assert choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (_format({"type": "string", "pattern": "(a"}), "regex parse error"),
        (_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
         "uniqueItems"),
        (_format({"not": {"type": "string"}}), '"not"'),
        (_format({"type": "wat"}), "wat"),
        ({"type": "xml"}, "type must be 'text', 'json_object' or 'json_schema'"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "t"}}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {}, "strict": 1}},
         "json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {}, "x": 1}}, "'x'"),
        ({"type": "json_object", "json_schema": {}}, "'json_schema'"),
        ("json", "must be an object"),
    ],
)  # fmt: skip
def test_a_schema_the_engine_refuses_is_a_400_naming_it(
    client: openai.OpenAI, response_format: Any, message: str
) -> None:
    for create, args in (
        (client.chat.completions.create, {"messages": MESSAGES}),
        (client.completions.create, {"prompt": "x"}),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            create(model="gpt2", max_tokens=4, extra_body={"response_format": response_format},
                   **args)  # fmt: skip
        assert exc.value.param == "response_format", exc.value
        body = exc.value.body
        assert isinstance(body, dict)
        assert body["message"].startswith("response_format: ") and message in body["message"]
    # The server serves on.
    ok = client.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_langchain_with_structured_output(decoder_server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="gpt2", base_url=decoder_server.base + "/v1", api_key="x", max_retries=0,
        max_completion_tokens=110, seed=5, temperature=1.0,
    )  # fmt: skip
    structured = llm.with_structured_output(Order, method="json_schema")
    for prompt in ("An order", "Another order"):
        result = structured.invoke(prompt)
        assert isinstance(result, Order)
    raw = llm.with_structured_output(Order, method="json_schema", include_raw=True).invoke("x")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Order)
