"""Tool calls generated under the grammar, over the OpenAI API on a real server
(the openai SDK and LangChain against the tiny gpt2, its steps in a step
process): tool_choice "required" or a named function gives one call whose
arguments validate against the tool's parameters, streamed as whole; "none"
is free text; "auto" and malformed tools are refused by name."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from conftest import ServerProcess
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "The weather?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
]  # fmt: skip
PARAMS = {"get_weather": WEATHER, "get_time": TIME}


class Lookup(BaseModel):
    word: str = Field(max_length=5)
    limit: int = Field(ge=1, le=3)


@pytest.fixture
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model="gpt2", messages=MESSAGES, tools=TOOLS, tool_choice=_named("get_weather"),
            max_tokens=100, seed=seed,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    for seed in range(4):
        answer = client.chat.completions.create(
            model="gpt2", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=100, seed=seed, parallel_tool_calls=False,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_streamed_call_equals_the_whole_one(client: openai.OpenAI) -> None:
    for choice in ("required", _named("get_time")):
        args = {"model": "gpt2", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": 100, "seed": 5}  # fmt: skip
        whole = client.chat.completions.create(**args).choices[0]
        [call] = whole.message.tool_calls
        names, arguments, reasons = [], [], []
        for chunk in client.chat.completions.create(**args, stream=True):
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                assert not c.delta.content
                for d in c.delta.tool_calls or []:
                    assert d.index == 0
                    names.append(d.function.name)
                    arguments.append(d.function.arguments)
        assert names == [call.function.name]
        assert "".join(arguments) == call.function.arguments
        assert reasons[-1] == whole.finish_reason == "tool_calls"


def test_a_call_cut_short_is_text_with_length(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="gpt2", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=3
    )
    [choice] = answer.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("{")


def test_none_is_free_text(client: openai.OpenAI) -> None:
    args = {"model": "gpt2", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**args).choices[0].message.content
    answer = client.chat.completions.create(**args, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content == plain
    assert answer.choices[0].message.tool_calls is None


def test_the_sdk_parses_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Lookup)
    answer = client.chat.completions.parse(
        model="gpt2", messages=MESSAGES, tools=[tool], tool_choice=_named("Lookup"),
        max_tokens=100, seed=2,
    )  # fmt: skip
    [call] = answer.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": TOOLS}, "tool_choice", "'auto'"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "'auto'"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
        ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice", "no tool is named 'nope'"),
        ({"tools": TOOLS, "tool_choice": "some"}, "tool_choice", "must be 'none', 'required'"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
         "tools", "function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
          "tool_choice": _named("f")}, "tools", "Unimplemented keys"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "not both"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="gpt2", messages=MESSAGES, max_tokens=4, extra_body=extra
        )
    assert exc.value.param == param, exc.value
    assert isinstance(exc.value.body, dict) and message in exc.value.body["message"]


def test_langchain_structured_output_by_function_calling(decoder_server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="gpt2", base_url=decoder_server.base + "/v1", api_key="x", max_retries=0,
        max_completion_tokens=100, seed=4,
    )  # fmt: skip
    result = llm.with_structured_output(Lookup, method="function_calling").invoke("Find")
    assert isinstance(result, Lookup)
    bound = llm.bind_tools([Lookup], tool_choice="required", strict=True)
    message = bound.invoke("Find")
    assert message.response_metadata["finish_reason"] == "tool_calls", message
    [call] = message.tool_calls
    assert call["name"] == "Lookup"
    Lookup.model_validate(call["args"])
