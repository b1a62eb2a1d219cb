"""The OpenAI-compatible API, driven by the openai SDK (sync and async) against a real server."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import orjson
import pytest
from conftest import ServerProcess
from gen_helpers import EOS_PROMPT, gen_stats, idle, wait_gen

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["The quick brown fox", "Hello world!", "seven silver spoons"]


@pytest.fixture(scope="module")
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def aclient(decoder_server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = sorted(m.id for m in client.models.list())
    assert ids == ["gpt2", "gpt2-eos", "llama"]
    model = client.models.retrieve("llama")
    assert (model.id, model.object, model.owned_by) == ("llama", "model", "aserve")
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.models.retrieve("nope")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_completion_streamed_text_equals_whole_text(client: openai.OpenAI, model: str) -> None:
    for prompt in PROMPTS:
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        [choice] = whole.choices
        assert whole.object == "text_completion" and whole.model == model
        assert choice.finish_reason == "length" and len(choice.text) > 5
        assert whole.usage is not None and whole.usage.completion_tokens == 24
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24

        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
        )
        assert len(chunks) > 3  # arrived in pieces
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("model", ["gpt2", "llama"])
async def test_chat_streamed_text_equals_whole_text(
    aclient: openai.AsyncOpenAI, model: str
) -> None:
    messages = [
        {"role": "system", "content": "You are tiny."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}],
        },
    ]
    whole = await aclient.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=20, temperature=0
    )
    [choice] = whole.choices
    assert whole.object == "chat.completion"
    assert choice.message.role == "assistant" and len(choice.message.content or "") > 3
    assert choice.finish_reason == "length"

    stream = await aclient.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    # LiteLLM's checks: one id and one created time for every chunk of a stream.
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert all(c.usage is None for c in chunks[:-1])
    usage_chunk, finish_chunk = chunks[-1], chunks[-2]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert whole.usage is not None and whole.usage.completion_tokens == 20
    got = usage_chunk.usage
    assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (
        whole.usage.prompt_tokens, 20, whole.usage.prompt_tokens + 20,
    )  # fmt: skip
    assert finish_chunk.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content


def test_chat_template_default_and_own(client: openai.OpenAI) -> None:
    """Both models chat: llama with its own template, gpt2 with the default format;
    the prompt token counts show what each template rendered."""
    messages = [{"role": "user", "content": "Hello"}]
    counts = {}
    for model in ("llama", "gpt2"):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        counts[model] = r.usage.prompt_tokens  # type: ignore[union-attr]
    # llama: "<s><|user|>Hello</s><|assistant|>"; gpt2: "user: Hello\nassistant:".
    assert counts["llama"] > 4 and counts["gpt2"] > 4


def test_stop_string_ends_with_stop(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(model="llama", prompt=PROMPTS[1], max_tokens=30, temperature=0)
        .choices[0]
        .text
    )
    stop = full[8:11]
    assert stop.strip() and full.index(stop) >= 4
    r = client.completions.create(
        model="llama", prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop, "\x00"]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens < 30


def test_eos_ends_with_stop(client: openai.OpenAI, decoder_models: dict[str, Any]) -> None:
    for stream in (False, True):
        r: Any = client.completions.create(
            model="gpt2-eos", prompt=EOS_PROMPT, max_tokens=16, temperature=0, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )  # fmt: skip
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert reason == "stop"
        assert usage.completion_tokens == decoder_models["eos_tokens"]  # the end token counts
        assert text == decoder_models["eos_text"]  # but adds no text


def test_max_tokens_ends_with_length_and_ignore_eos(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="gpt2-eos", prompt=EOS_PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kind", "body", "param", "message"),
    [
        ("cmpl", {"n": 0}, "n", "from 1 to 128"),
        ("cmpl", {"n": 9}, "n", "more than this model runs at once (generation.max_num_seqs 8)"),
        ("cmpl", {"n": 3, "best_of": 2}, "best_of", "must be at least n (3)"),
        ("cmpl", {"best_of": 2, "stream": True}, "best_of", "more than n cannot be streamed"),
        ("cmpl", {"temperature": 3}, "temperature", "from 0 to 2"),
        ("cmpl", {"max_tokens": 0}, "max_tokens", ">= 1"),
        ("cmpl", {"max_tokens": 121}, "max_tokens", "over this model's limit (120)"),
        ("cmpl", {"prompt": "word " * 200}, "prompt", "max_model_len (128)"),
        ("cmpl", {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ("cmpl", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ("cmpl", {"logprobs": 21}, "logprobs", "from 0 to 20"),
        ("cmpl", {"logprobs": True}, "logprobs", "must be an integer"),
        ("cmpl", {"echo": True}, "echo", "not supported"),
        ("cmpl", {"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ("chat", {"messages": []}, "messages", "non-empty list"),
        ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
            "tool_choice",
            "must be 'auto'",
        ),
        ("chat", {"response_format": {"type": "json"}}, "response_format", "'json_object'"),
        ("chat", {"top_p": 0}, "top_p", "(0, 1]"),
    ],
)
async def test_bad_requests_get_openai_errors(
    aclient: openai.AsyncOpenAI, kind: str, body: dict[str, Any], param: str, message: str
) -> None:
    base: dict[str, Any] = (
        {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
        if kind == "chat"
        else {"model": "llama", "prompt": "hi"}
    )
    args = {**base, **body}
    create = aclient.chat.completions.create if kind == "chat" else aclient.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        await create(**args)
    assert exc.value.status_code == 400
    assert exc.value.param == param
    assert exc.value.type == "invalid_request_error"
    assert message in exc.value.message and param.split("_")[0] in exc.value.message
    assert exc.value.response.headers["x-should-retry"] == "false"


async def test_unknown_model_is_404(aclient: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        await aclient.completions.create(model="nope", prompt="hi")
    assert exc.value.code == "model_not_found" and exc.value.param == "model"


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from gen_helpers import start_gpt2_server

    server = start_gpt2_server(tmp_path_factory, "one-slot", max_num_seqs=1)
    yield server
    server.stop()


async def test_failure_after_the_stream_started_is_an_error_event(one_slot_server: Any) -> None:
    """A request whose deadline passes while it waits for a slot, after its
    stream has started: the error travels in the stream and the SDK raises it
    while iterating. The only slot is held by a generation whose step process
    is stopped, so the wait outlasts the deadline on a machine of any speed."""
    from helpers import frozen

    base = one_slot_server.base
    aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    holder = await aclient.completions.create(
        model="gpt2", prompt="Hello", max_tokens=120, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    await holder.__anext__()  # it runs: the one slot is taken
    (child,) = one_slot_server.spawned_children()
    with frozen(child.pid):
        stream = await aclient.completions.create(
            model="gpt2", prompt="Hello", max_tokens=4, stream=True,
            extra_headers={"aserve-timeout-ms": "1500"},
        )  # fmt: skip
        with pytest.raises(openai.APIError, match="timed out"):
            async for _ in stream:
                pass
    await holder.close()
    # Before it started, the same failure is a status: 504, not retried.
    with pytest.raises(openai.InternalServerError) as exc:
        await aclient.completions.create(
            model="gpt2", prompt="Hello", max_tokens=120, extra_body={"ignore_eos": True},
            extra_headers={"aserve-timeout-ms": "1"},
        )  # fmt: skip
    assert exc.value.status_code == 504 and exc.value.type == "timeout_error"
    async with aiohttp.ClientSession() as session:
        s = await wait_gen(session, base, "gpt2", idle)
        # The one that waited for the slot; the 1 ms one is counted too unless it was
        # refused on arrival, which depends on how fast the machine reached it.
        assert s["timed_out"] >= 1
    await aclient.close()


async def test_raw_sse_framing(decoder_server: ServerProcess) -> None:
    body = {"model": "llama", "prompt": "Hello", "max_tokens": 5, "stream": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(decoder_server.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["Cache-Control"] == "no-cache"
            raw = await r.read()  # returns: the body ends right after [DONE]
        events = raw.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        docs = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        assert all(d["object"] == "text_completion" for d in docs)
        assert docs[-1]["choices"][0]["finish_reason"] == "length"
        s = await gen_stats(session, decoder_server.base, "llama")
        assert s["generation"]["generated_tokens"] >= 5


async def test_errors_before_the_stream_are_statuses(decoder_server: ServerProcess) -> None:
    async with aiohttp.ClientSession() as session:
        url = decoder_server.base + "/v1/chat/completions"
        async with session.post(url, data=b"{not json") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with session.post(url, json={"model": "llama", "stream": True}) as r:
            assert r.status == 400 and r.headers["Content-Type"].startswith("application/json")
            assert (await r.json())["error"]["param"] == "messages"


# --- every field honoured or refused, never silently ignored --------------------------------

CHAT_MESSAGES = [{"role": "user", "content": "Hello"}]
# Fields found silently ignored, each with a value that asks for something.
REFUSED_CHAT: list[tuple[str, Any]] = [
    ("best_of", 2), ("echo", True), ("suffix", "The end."),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "Hello"}), ("store", True),
    ("metadata", {"user": "u1"}), ("service_tier", "flex"), ("reasoning_effort", "high"),
    ("web_search_options", {}), ("verbosity", "low"), ("top_logprobs", 2),
    ("min_p", 0.1),  # vLLM's, unknown here
]  # fmt: skip
REFUSED_COMPLETIONS: list[tuple[str, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("response_format", {"type": "xml"}), ("tool_choice", "auto"),
    ("suffix", "x"),
    ("max_completion_tokens", 4), ("messages", CHAT_MESSAGES),  # chat's, not completions'
]  # fmt: skip


def _message(error: openai.APIStatusError) -> str:
    """The server's own message (the SDK's ``message`` puts the status first)."""
    assert isinstance(error.body, dict)
    return str(error.body["message"])


def _sdk_args(create: Any, name: str, value: Any) -> dict[str, Any]:
    """The field as the SDK's own argument where it has one, else in extra_body."""
    import inspect

    if name in inspect.signature(create).parameters:
        return {name: value}
    return {"extra_body": {name: value}}


def _refused_with_its_name(exc: pytest.ExceptionInfo[openai.BadRequestError], name: str) -> None:
    assert exc.value.status_code == 400 and exc.value.param == name, exc.value
    assert _message(exc.value).startswith(f"{name}: "), exc.value.message
    assert exc.value.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("name", "value"), REFUSED_CHAT, ids=[n for n, _ in REFUSED_CHAT])
async def test_chat_fields_asking_for_what_aserve_lacks_are_refused_by_name(
    aclient: openai.AsyncOpenAI, name: str, value: Any
) -> None:
    create = aclient.chat.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        await create(
            model="llama", messages=CHAT_MESSAGES, max_tokens=2, **_sdk_args(create, name, value)
        )  # type: ignore[call-overload]
    _refused_with_its_name(exc, name)


@pytest.mark.parametrize(
    ("name", "value"), REFUSED_COMPLETIONS, ids=[n for n, _ in REFUSED_COMPLETIONS]
)
async def test_completion_fields_asking_for_what_aserve_lacks_are_refused_by_name(
    aclient: openai.AsyncOpenAI, name: str, value: Any
) -> None:
    create = aclient.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        await create(model="llama", prompt="Hello", max_tokens=2, **_sdk_args(create, name, value))  # type: ignore[call-overload]
    _refused_with_its_name(exc, name)


async def test_fields_clients_send_by_default_change_nothing(aclient: openai.AsyncOpenAI) -> None:
    """The values a client sends to mean "no such feature" pass, and the text is
    what the same request gets without them."""
    plain = await aclient.chat.completions.create(
        model="llama", messages=CHAT_MESSAGES, max_tokens=12, temperature=0
    )
    defaults = await aclient.chat.completions.create(
        model="llama", messages=CHAT_MESSAGES, max_completion_tokens=12, max_tokens=12,
        temperature=0, n=1, store=False, metadata={}, service_tier="auto", logprobs=False,
        top_logprobs=0, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=[],
        tool_choice="none", parallel_tool_calls=False, user="u1", safety_identifier="s1",
        prompt_cache_key="k1", response_format={"type": "text"}, modalities=["text"],
        reasoning_effort="none", audio=None, prediction=None,
    )  # fmt: skip
    assert defaults.choices[0].message.content == plain.choices[0].message.content
    whole = await aclient.completions.create(
        model="llama", prompt="Hello", max_tokens=12, temperature=0
    )
    same = await aclient.completions.create(
        model="llama", prompt="Hello", max_tokens=12, temperature=0, n=1, best_of=1, echo=False,
        logprobs=None, presence_penalty=0, frequency_penalty=0, logit_bias={}, suffix=None, user="u1",
    )  # fmt: skip
    assert same.choices[0].text == whole.choices[0].text
    stream = await aclient.chat.completions.create(
        model="llama", messages=CHAT_MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as exc:
        await aclient.chat.completions.create(
            model="llama", messages=CHAT_MESSAGES, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": True},
        )  # fmt: skip
    assert exc.value.param == "stream_options" and "include_obfuscation" in exc.value.message


async def test_langchain_chat_openai_bodies_are_served(decoder_server: ServerProcess) -> None:
    """The bodies LangChain's ChatOpenAI (langchain-openai 1.7) sends for invoke
    and stream, with and without its settings."""
    bodies = [
        {"model": "llama", "stream": False, "messages": [
            {"content": "s", "role": "system"}, {"content": "hello", "role": "user"},
            {"content": "hi", "role": "assistant"}, {"content": "again", "role": "user"}]},
        {"model": "llama", "stream": False, "messages": [{"content": "x", "role": "user"}],
         "max_completion_tokens": 5, "temperature": 0.0},
        {"model": "llama", "stream": True, "messages": [{"content": "x", "role": "user"}],
         "max_completion_tokens": 5, "n": 1, "seed": 1, "stop": ["a"], "temperature": 0.2,
         "top_p": 0.9, "stream_options": {"include_usage": True}},
    ]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(decoder_server.base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()


async def test_history_keys_are_honoured_or_refused(aclient: openai.AsyncOpenAI) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history: list[Any] = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    # The call and its result are served (written into the messages: the llama
    # template does not render tools).
    r = await aclient.chat.completions.create(model="llama", messages=history, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    # Without the call, the tool message answers nothing.
    history[1] = {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None}
    with pytest.raises(openai.BadRequestError) as exc:
        await aclient.chat.completions.create(model="llama", messages=history, max_tokens=2)
    assert exc.value.param == "messages"
    assert _message(exc.value).startswith("messages[2].tool_call_id: 'c1' is the id of no"), exc
    for key, value in (("reasoning_content", "hm"), ("refusal", "no"), ("audio", {"id": "a"})):
        with pytest.raises(openai.BadRequestError) as exc:
            await aclient.chat.completions.create(
                model="llama",
                messages=[{"role": "assistant", "content": "x", key: value}],
                max_tokens=2,
            )
        assert exc.value.param == "messages" and f"messages[0].{key}" in exc.value.message


async def test_max_tokens_refusals_name_the_field_the_request_used(
    aclient: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await aclient.chat.completions.create(
            model="llama", messages=CHAT_MESSAGES, max_completion_tokens=121
        )
    assert exc.value.param == "max_completion_tokens"
    assert _message(exc.value) == "max_completion_tokens: 121 is over this model's limit (120)"
    with pytest.raises(openai.BadRequestError) as exc:
        await aclient.chat.completions.create(
            model="llama", messages=CHAT_MESSAGES, max_completion_tokens=20, max_tokens=10
        )
    assert exc.value.param == "max_tokens" and "not both (got 10 and 20)" in exc.value.message
