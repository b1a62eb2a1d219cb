"""LangChain's ChatOpenAI pointed at a real aserve (the tiny decoders, whose wits
do not matter): invoke, stream with usage, batch, stop sequences, log
probabilities and n, as its standard tests check them."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.timeout(120)


def _chat(server: ServerProcess, **extra: Any) -> Any:
    settings = {"temperature": 0, "max_tokens": 8, **extra}
    return langchain_openai.ChatOpenAI(
        base_url=server.base + "/v1", api_key="x", model="llama", max_retries=0, **settings
    )


def test_invoke_answers_an_ai_message_with_usage(decoder_server: ServerProcess) -> None:
    message = _chat(decoder_server).invoke("Hello there")
    assert isinstance(message.content, str) and message.content
    usage = message.usage_metadata
    assert usage is not None and usage["output_tokens"] == 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert message.response_metadata["finish_reason"] == "length"
    assert message.response_metadata["model_name"] == "llama"


def test_stream_chunks_add_up_to_the_invoked_answer(decoder_server: ServerProcess) -> None:
    chat = _chat(decoder_server, stream_usage=True)
    whole = chat.invoke("Tell me a story")
    chunks = list(chat.stream("Tell me a story"))
    assert len(chunks) > 2
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content == whole.content
    # LangChain's standard test: one chunk carries the usage, and it adds up.
    assert merged.usage_metadata is not None
    assert merged.usage_metadata["output_tokens"] == 8
    assert merged.usage_metadata["total_tokens"] == (
        merged.usage_metadata["input_tokens"] + merged.usage_metadata["output_tokens"]
    )
    assert len({c.id for c in chunks}) == 1  # one id for the whole stream


def test_batch_stop_logprobs_and_n(decoder_server: ServerProcess) -> None:
    answers = _chat(decoder_server).batch(["one", "two", "three"])
    assert len(answers) == 3 and all(a.content for a in answers)
    plain = _chat(decoder_server, max_tokens=20).invoke("Tell me a story").content
    word = plain.split()[1] if len(plain.split()) > 1 else plain[1:3]
    stopped = _chat(decoder_server, max_tokens=20).invoke("Tell me a story", stop=[word])
    assert word not in stopped.content and plain.startswith(stopped.content)
    assert stopped.response_metadata["finish_reason"] == "stop"
    scored = _chat(decoder_server, logprobs=True, top_logprobs=2).invoke("Hi")
    content = scored.response_metadata["logprobs"]["content"]
    assert len(content) == 8 and all(len(e["top_logprobs"]) == 2 for e in content)
    from langchain_core.messages import HumanMessage

    result = _chat(decoder_server, n=2, temperature=1.0, seed=4).generate([[HumanMessage("Hi")]])
    assert len(result.generations[0]) == 2
