"""Tool calls over the OpenAI API on a real server (the openai SDK and LangChain
against two tiny gpt2s with Hermes' ``<tool_call>`` tokens: ``hermes``, whose
chat template renders tools and calls, and ``plain``, without a template, to
which aserve writes them as text).

The models are random; what a test pins comes from the grammar's guarantees
and from ``logit_bias``: +100 on the ``<tool_call>`` token makes the model
start a call, -100 on every token holding ``<`` keeps it from ever starting
one, +100 on the newline token makes it start another call after each one
(the grammar allows nothing else there but the end)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import lm_models
import openai
import pytest
import tokenizers
from conftest import ServerProcess, start_server, write_config
from pydantic import BaseModel, Field

from aserve.frontends.http.openai_tools import tools_text

pytestmark = pytest.mark.timeout(240)

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
MODELS = ("hermes", "plain")
GENERATION = {"max_num_seqs": 8, "max_model_len": 1024, "max_tokens_default": 64,
              "max_tokens_cap": 300}  # fmt: skip


class Lookup(BaseModel):
    word: str = Field(max_length=5)
    limit: int = Field(ge=1, le=3)


class Biases:
    """The logit biases the tests steer the random models with."""

    def __init__(self, folder: Path) -> None:
        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.call = tok.token_to_id("<tool_call>")
        self.newline = tok.token_to_id("Ċ")  # byte-level BPE's "\n"
        texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]
        self.no_angle = {str(i): -100 for i, t in enumerate(texts) if "<" in t}
        assert self.call is not None and self.newline is not None and self.no_angle

    @property
    def calling(self) -> dict[str, int]:
        return {str(self.call): 100}

    @property
    def calling_again(self) -> dict[str, int]:
        return {str(self.call): 100, str(self.newline): 100}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    hermes = lm_models.tiny_model("hermes", tmp_path_factory.getbasetemp() / "lms")
    plain = Path(shutil.copytree(hermes, tmp_path_factory.mktemp("tools") / "plain"))
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return {"hermes": hermes, "plain": plain}


@pytest.fixture(scope="module")
def tool_server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    models = [{"name": name, "engine": "decoder", "path": str(path), "generation": GENERATION}
              for name, path in folders.items()]  # fmt: skip
    srv = start_server(write_config(tmp_path_factory.mktemp("tool-server"), {"models": models}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bias(folders: dict[str, Path]) -> Biases:
    return Biases(folders["hermes"])


@pytest.fixture
def client(tool_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.base + "/v1", api_key="x", max_retries=0)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _valid(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def _streamed(client: openai.OpenAI, **args: Any) -> tuple[str, list[dict[str, Any]], str]:
    """A streamed answer's content, calls (by index) and last finish reason,
    with each chunk's shape checked."""
    content, calls, reasons = [], {}, []
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created) for c in chunks}) == 1
    for chunk in chunks:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            content.append(c.delta.content or "")
            for d in c.delta.tool_calls or []:
                assert d.index not in calls and d.index == len(calls)  # each once, in order
                assert d.id.startswith("call_") and d.type == "function"
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments}
    assert all(r is None for r in reasons[:-1])
    return "".join(content), [calls[i] for i in range(len(calls))], reasons[-1]


# --- auto -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_auto_answers_in_text_when_no_call_can_start(
    client: openai.OpenAI, bias: Biases, model: str
) -> None:
    for seed in range(3):
        args = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 24,
                "seed": seed, "logit_bias": bias.no_angle}  # fmt: skip
        [choice] = client.chat.completions.create(**args).choices
        assert choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str) and "<" not in choice.message.content
        content, calls, reason = _streamed(client, **args)
        assert (content, calls, reason) == (choice.message.content, [], choice.finish_reason)


@pytest.mark.parametrize("model", MODELS)
def test_auto_calls_a_tool_with_valid_arguments(
    client: openai.OpenAI, bias: Biases, model: str
) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, max_tokens=150, seed=seed,
            logit_bias=bias.calling, parallel_tool_calls=False,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        _valid(call)


@pytest.mark.parametrize("model", MODELS)
def test_a_streamed_auto_call_equals_the_whole_one(
    client: openai.OpenAI, bias: Biases, model: str
) -> None:
    args = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
            "max_tokens": 150, "seed": 7, "logit_bias": bias.calling,
            "parallel_tool_calls": False}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0]
    content, calls, reason = _streamed(client, **args)
    assert content == "" and whole.message.content is None
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in whole.message.tool_calls]  # fmt: skip
    assert reason == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_calls_are_several_unless_turned_off(
    client: openai.OpenAI, bias: Biases, choice: str
) -> None:
    args = {"model": "plain", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
            "max_tokens": 200, "seed": 3, "logit_bias": bias.calling_again}  # fmt: skip
    # After each call the newline's bias starts another, until max_tokens cuts one short.
    several = client.chat.completions.create(**args).choices[0]
    assert several.finish_reason == "length"
    assert len(several.message.tool_calls) >= 2
    for call in several.message.tool_calls:
        _valid(call)
    assert len({c.id for c in several.message.tool_calls}) == len(several.message.tool_calls)
    content, calls, reason = _streamed(client, **args)
    assert [c["name"] for c in calls] == [c.function.name for c in several.message.tool_calls]
    assert [c["arguments"] for c in calls] == [
        c.function.arguments for c in several.message.tool_calls
    ]
    assert (content, reason) == (several.message.content, "length")
    one = client.chat.completions.create(**args, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls"
    [call] = one.message.tool_calls
    _valid(call)


# --- required, a named function, none ---------------------------------------------------


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model="plain", messages=MESSAGES, tools=TOOLS, tool_choice=_named("get_weather"),
            max_tokens=100, seed=seed,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _valid(call)


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    for seed in range(4):
        answer = client.chat.completions.create(
            model="hermes", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=100, seed=seed, parallel_tool_calls=False,
        )  # fmt: skip
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        _valid(call)


def test_a_streamed_call_equals_the_whole_one(client: openai.OpenAI) -> None:
    for choice in ("required", _named("get_time")):
        args = {"model": "plain", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": 100, "seed": 5, "parallel_tool_calls": False}  # fmt: skip
        whole = client.chat.completions.create(**args).choices[0]
        [call] = whole.message.tool_calls
        content, calls, reason = _streamed(client, **args)
        assert content == ""
        assert calls == [{"name": call.function.name, "arguments": call.function.arguments}]
        assert reason == whole.finish_reason == "tool_calls"


def test_a_call_cut_short_is_text_with_length(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="plain", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=3
    )
    [choice] = answer.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and "<tool_call>".startswith(choice.message.content[:11])


def test_none_is_free_text(client: openai.OpenAI) -> None:
    args = {"model": "hermes", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    answer = client.chat.completions.create(**args, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_the_sdk_parses_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Lookup)
    answer = client.chat.completions.parse(
        model="plain", messages=MESSAGES, tools=[tool], tool_choice=_named("Lookup"),
        max_tokens=100, seed=2,
    )  # fmt: skip
    [call] = answer.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


# --- tool calls in the history ----------------------------------------------------------

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "The weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
]


def test_a_history_is_written_as_text_for_a_template_without_tools(
    client: openai.OpenAI,
) -> None:
    """What ``plain`` is sent is exactly the documented text: the same prompt,
    token for token, and the same answer, as that text sent as a completion's
    prompt in the default chat format (``role: content`` lines)."""
    args = {"model": "plain", "max_tokens": 8, "temperature": 0}
    # tool_choice none: free text, as the completion's (auto's grammar keeps to UTF-8).
    answer = client.chat.completions.create(
        **args, messages=HISTORY, tools=TOOLS, tool_choice="none"
    )
    written = (
        f"system: {tools_text(TOOLS)}\n"
        "user: The weather in Oslo?\n"
        'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n'
        "tool: <tool_response>\nrain\n</tool_response>\n"
        "assistant:"
    )
    same = client.completions.create(**args, prompt=written)
    assert answer.usage.prompt_tokens == same.usage.prompt_tokens
    assert answer.choices[0].message.content == same.choices[0].text
    bare = client.chat.completions.create(**args, messages=HISTORY[:1])
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens


def test_a_template_that_reads_tools_gets_the_calls_arguments_as_objects(
    client: openai.OpenAI,
) -> None:
    # The hermes template raises unless each call's arguments are a mapping.
    args = {"model": "hermes", "max_tokens": 8, "temperature": 0}
    answer = client.chat.completions.create(**args, messages=HISTORY, tools=TOOLS)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    without = client.chat.completions.create(**args, messages=HISTORY[:1], tools=TOOLS)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens


# --- refusals -----------------------------------------------------------------------------


def _with(i: int, **keys: Any) -> list[dict[str, Any]]:
    history = [dict(m) for m in HISTORY]
    history[i].update(keys)
    return [{k: v for k, v in m.items() if v is not ...} for m in history]


def _call(**function: Any) -> list[dict[str, Any]]:
    return [{**CALL, "function": {**CALL["function"], **function}}]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
        ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice", "no tool is named 'nope'"),
        ({"tools": TOOLS, "tool_choice": "some"}, "tool_choice", "must be 'auto', 'none'"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
         "tools", "Unimplemented keys"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
         "not both"),
        ({"messages": _with(2, tool_call_id=...)}, "messages",
         "messages[2].tool_call_id is required"),
        ({"messages": _with(2, tool_call_id="call_9")}, "messages",
         "messages[2].tool_call_id: 'call_9' is the id of no tool call"),
        ({"messages": _with(0, tool_calls=[CALL])}, "messages", "messages[0].tool_calls: only"),
        ({"messages": _with(1, tool_calls={"id": "x"})}, "messages", "must be a list"),
        ({"messages": _with(1, tool_calls=[{"type": "function"}])}, "messages",
         "messages[1].tool_calls[0].id"),
        ({"messages": _with(1, tool_calls=[{**CALL, "type": "code"}])}, "messages",
         "tool_calls[0].type: must be 'function'"),
        ({"messages": _with(1, tool_calls=_call(arguments="{city"))}, "messages",
         "tool_calls[0].function.arguments: must be the JSON text of an object"),
        ({"messages": _with(1, tool_calls=_call(arguments="[1]"))}, "messages",
         "function.arguments"),
        ({"messages": _with(1, tool_calls=_call(name=7))}, "messages", "function.name"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"messages": MESSAGES, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="plain", max_tokens=4, **body)
    assert exc.value.param == param, exc.value
    assert isinstance(exc.value.body, dict) and message in exc.value.body["message"]


# --- LangChain ----------------------------------------------------------------------------


def _langchain(server: ServerProcess, model: str, **settings: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model=model, base_url=server.base + "/v1", api_key="x", max_retries=0,
        **{"max_completion_tokens": 100, **settings},
    )  # fmt: skip


def test_langchain_structured_output_by_function_calling(tool_server: ServerProcess) -> None:
    llm = _langchain(tool_server, "plain", seed=4)
    # strict: additionalProperties false, so that the random model's keys end.
    result = llm.with_structured_output(Lookup, method="function_calling", strict=True).invoke(
        "Find"
    )
    assert isinstance(result, Lookup)
    bound = llm.bind_tools([Lookup], tool_choice="required", strict=True)
    message = bound.invoke("Find")
    assert message.response_metadata["finish_reason"] == "tool_calls", message
    [call] = message.tool_calls
    assert call["name"] == "Lookup"
    Lookup.model_validate(call["args"])


@pytest.mark.parametrize("model", MODELS)
def test_langchain_round_trip_call_result_answer(
    tool_server: ServerProcess, bias: Biases, model: str
) -> None:
    """bind_tools with tool_choice auto: the model's call, a ToolMessage with the
    result, and the next turn answered."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = _langchain(tool_server, model, seed=1, logit_bias=bias.calling)
    bound = llm.bind_tools([Lookup], parallel_tool_calls=False, strict=True)
    asked = HumanMessage("Find a word")
    message = bound.invoke([asked])
    assert message.response_metadata["finish_reason"] == "tool_calls", message
    [call] = message.tool_calls
    Lookup.model_validate(call["args"])
    result = ToolMessage(content="3 matches", tool_call_id=call["id"])
    plain = _langchain(tool_server, model, seed=1, max_completion_tokens=8)
    answer = plain.bind_tools([Lookup], tool_choice="none").invoke([asked, message, result])
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata is not None
    first = plain.invoke([asked])
    assert answer.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]
