"""The pieces of chat's tool calls without a server: the grammar's guarantees
(llguidance on the tiny hermes tokenizer), the reader that splits an answer
into content and calls as it streams, and the text a template without tools
is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lm_models
import pytest

from aserve.config import GenerationConfig
from aserve.engines.decoder import grammar as engine_grammar
from aserve.engines.decoder.grammar import Grammars
from aserve.engines.decoder.tokenizer import Tokenizer
from aserve.errors import TooLarge
from aserve.frontends.http import openai_tools
from aserve.frontends.http.openai_fields import FieldError
from aserve.frontends.http.openai_tools import (
    CallReader,
    history_calls,
    read_answer,
    render_as_text,
    tool_plan,
    tools_text,
)
from aserve.loop.prompt_size import check_prompt_size

pytestmark = pytest.mark.timeout(120)

ARGS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "Eff", "parameters": ARGS}},
    {"type": "function", "function": {"name": "g"}},
]
F1 = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Grammars]:
    folder = lm_models.tiny_model("hermes", tmp_path_factory.getbasetemp() / "lms")
    tok = Tokenizer.load(folder)
    return tok, Grammars(tok, tok.vocab_size)


def _feed(engine: tuple[Tokenizer, Grammars], grammar: str, text: str) -> Any:
    """The matcher after ``text`` (None: refused on the way)."""
    tok, grammars = engine
    m = grammars.matcher(grammar)
    ok = m.consume_tokens(tok.inner.encode(text, add_special_tokens=False).ids)
    return m if ok else None


def _grammar(choice: Any, parallel: bool | None = None) -> str:
    plan, _ = tool_plan(TOOLS, choice, parallel)
    assert plan is not None
    return plan.grammar


def test_auto_allows_text_or_text_then_calls_and_holds_a_started_call(engine: Any) -> None:
    auto = _grammar("auto")
    assert _feed(engine, auto, "Hello <b> there").is_accepting()  # the end may come here
    assert _feed(engine, auto, f"Let me see.\n{F1}\n{G}").is_accepting()
    started = _feed(engine, auto, "hm <tool_call>\n")
    assert started is not None and not started.is_accepting()  # no end inside a call
    assert _feed(engine, auto, "hm <tool_call> later") is None  # a call starts on its line
    assert _feed(engine, auto, '<tool_call>\n{"name": "h"') is None  # no such tool
    assert _feed(engine, auto, '<tool_call>\n{"name": "f", "arguments": {"b"') is None
    assert _feed(engine, auto, f"{F1} and text after") is None


def test_parallel_false_stops_after_one_call_and_required_allows_no_text(engine: Any) -> None:
    assert _feed(engine, _grammar("auto", False), f"x {F1}").is_stopped()
    assert _feed(engine, _grammar("required", False), F1).is_stopped()
    assert _feed(engine, _grammar("required"), f"{F1}\n{G}").is_accepting()
    assert _feed(engine, _grammar("required"), "text") is None
    named = _grammar({"type": "function", "function": {"name": "g"}})
    assert _feed(engine, named, F1) is None
    assert _feed(engine, named, G).is_stopped()


def test_the_marker_token_is_allowed_where_its_text_is(engine: Any) -> None:
    tok, grammars = engine
    marker = tok.inner.token_to_id("<tool_call>")
    m = grammars.matcher(_grammar("auto"))
    assert m.consume_token(marker)


def test_the_json_options_are_the_engines() -> None:
    assert openai_tools.JSON_OPTIONS == engine_grammar.JSON_OPTIONS


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_streamed_answer_reads_as_the_whole_one(size: int) -> None:
    for text, reason in [
        (f"Sure thing. \n{F1}\n{G}", "stop"),
        ("plain text <b> with <tool and\n spaces  ", "stop"),
        (f'{F1}\n<tool_call>\n{{"name": "g", "argu', "length"),
        ("", "stop"),
    ]:
        whole = read_answer(text, reason)
        reader, content, calls = CallReader(), [], []
        for piece in _pieces(text, size):
            sent, made = reader.push(piece)
            content.append(sent)
            calls.extend(made)
        left, end = reader.end(reason)
        content.append(left)
        joined = "".join(content)
        assert ((joined or None) if calls else joined) == whole[0]
        assert [c["function"] for c in calls] == [c["function"] for c in whole[1]]
        assert end == whole[2]


def test_an_answer_is_split_into_content_and_calls() -> None:
    content, calls, reason = read_answer(f"Sure thing. \n{F1}\n{G}", "stop")
    assert content == "Sure thing." and reason == "tool_calls"
    assert [c["function"] for c in calls] == [
        {"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}
    ]  # fmt: skip
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert read_answer(F1, "stop")[0] is None  # no text: null, as OpenAI
    assert read_answer("no call", "stop") == ("no call", [], "stop")
    # Cut short inside a call: the calls made, and the rest as content.
    cut = read_answer(f"{F1}\n<tool_call>\n{{", "length")
    assert cut[0] == "<tool_call>\n{" and len(cut[1]) == 1 and cut[2] == "length"


def test_text_is_held_only_while_it_could_still_start_a_call() -> None:
    reader = CallReader()
    assert reader.push("a <too") == ("a", [])
    assert reader.push("th") == (" <tooth", [])  # no longer a start
    assert reader.push(" \n") == ("", [])  # whitespace waits: a call may follow
    assert reader.push("b") == (" \nb", [])
    assert reader.end("stop") == ("", "stop")


def test_a_template_without_tools_is_given_them_as_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Looking.", "tool_calls": history_calls([call], "m")},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    written = render_as_text(messages, TOOLS, parallel=False)
    assert written == [
        {"role": "system", "content": "Be brief.\n\n" + tools_text(TOOLS, False)},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content":
         'Looking.\n<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n42\n</tool_response>",
         "tool_call_id": "c1"},
    ]  # fmt: skip
    assert messages[2]["content"] == "Looking."  # the request's own messages are left alone
    text = tools_text(TOOLS)
    for tool in TOOLS:
        assert json.dumps(tool) in text.splitlines()
    assert "<tool_call>" in text and "<tool_response>" in text
    # No system message: one of their own comes first; no tools: none.
    assert render_as_text(messages[1:], TOOLS)[0] == {"role": "system", "content": text}
    assert render_as_text(messages[1:2], None) == messages[1:2]


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        ("x", "m.tool_calls: must be a list"),
        ([{"id": "a", "type": "function"}], "m.tool_calls[0].function: must be"),
        ([{"id": "", "function": {"name": "f", "arguments": "{}"}}], "m.tool_calls[0].id"),
        ([{"id": "a", "function": {"name": "f", "arguments": {"a": 1}}}], "function.arguments"),
        ([{"id": "a", "function": {"name": "f", "arguments": "{"}}], "the JSON text of an object"),
        ([{"id": "a", "extra": 1, "function": {"name": "f", "arguments": "{}"}}],
         "m.tool_calls[0]: must be"),
    ],
)  # fmt: skip
def test_malformed_history_calls_are_named(calls: Any, message: str) -> None:
    with pytest.raises(FieldError) as exc:
        history_calls(calls, "m")
    assert exc.value.param == "messages" and message in exc.value.message


def test_the_grammar_refuses_what_the_engine_cannot_enforce(engine: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]
    plan, _ = tool_plan(tools, "auto")
    assert plan is not None
    with pytest.raises(engine_grammar.GrammarError, match="Unimplemented keys"):
        engine[1].compile(plan.grammar)


def test_a_tokenizer_without_added_tokens_is_left_as_it_is(tmp_path: Path) -> None:
    folder = lm_models.tiny_model("gpt2", tmp_path.parent / "lms")
    text = (folder / "tokenizer.json").read_text()
    assert engine_grammar._plain_added_tokens(text) == text


def test_a_block_that_is_not_a_call_stays_text() -> None:
    # The grammar writes no such block; read without it, it is content.
    text = "<tool_call>\n[1, 2]\n</tool_call>"
    assert read_answer(text, "stop") == (text, [], "stop")


def test_tools_and_history_calls_are_bounded_before_they_are_written() -> None:
    big = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000}}
           for i in range(100)]  # fmt: skip
    with pytest.raises(FieldError, match=r"tools: \d+ bytes as JSON; at most"):
        tool_plan(big, "none")
    gen = GenerationConfig(max_prompt_bytes=1000)
    call = {"id": "c", "function": {"name": "f", "arguments": "{" + " " * 2000 + "}"}}
    with pytest.raises(TooLarge, match="messages"):
        check_prompt_size(gen, messages=[{"role": "assistant", "tool_calls": [call]}])
