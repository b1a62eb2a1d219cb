"""Log probabilities over the OpenAI API on a real server (the openai SDK against
the tiny decoders, their steps in a step process): chat's content list and
completions' four lists, streamed and whole alike, consistent with the tokens
generated; of the model's own distribution (a bias does not change them);
bounds refused by name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import tokenizers
from conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def _tokenizer(decoder_models: dict[str, Any]) -> tokenizers.Tokenizer:
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    return tokenizers.Tokenizer.from_file(str(Path(gpt2["path"]) / "tokenizer.json"))


def test_chat_logprobs_name_each_token_with_its_alternatives(client) -> None:
    answer = client.chat.completions.create(
        model="gpt2", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    [choice] = answer.choices
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens == 12
    assert "".join(e.token for e in content) == choice.message.content
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the token drawn is the most likely one.
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    # logprobs without top_logprobs: the tokens' own, no alternatives.
    plain = client.chat.completions.create(
        model="gpt2", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * 4
    none = client.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_a_streamed_chat_carries_the_same_logprobs_as_the_whole_answer(client) -> None:
    args = {"model": "gpt2", "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in whole
    ]


def test_completion_logprobs_lists_and_offsets(client) -> None:
    answer = client.completions.create(
        model="gpt2", prompt="The sea", max_tokens=8, temperature=0, logprobs=2
    )
    [choice] = answer.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == value and top[token] == value
    streamed_tokens, offsets = [], []
    for chunk in client.completions.create(
        model="gpt2", prompt="The sea", max_tokens=8, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert (streamed_tokens, offsets) == (lp.tokens, lp.text_offset)


def test_logprobs_are_the_models_own_before_a_bias(client, decoder_models) -> None:
    """A bias forces a token; its log probability is still the model's, so it is
    not the top alternative the model itself would rank first."""
    tok = _tokenizer(decoder_models)
    forced = tok.encode(" hello").ids[0]
    answer = client.completions.create(
        model="gpt2", prompt="The sea", max_tokens=3, temperature=0, logprobs=1,
        logit_bias={str(forced): 100},
    )  # fmt: skip
    lp = answer.choices[0].logprobs
    assert lp.tokens == [tok.decode([forced])] * 3
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        (best,) = top.values()
        assert value < best  # forced, not what the model ranks first


@pytest.mark.parametrize(
    ("kind", "extra", "param", "message"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "only allowed when logprobs is true"),
        ("chat", {"extra_body": {"logprobs": 3}}, "logprobs", "must be true or false"),
        ("cmpl", {"logprobs": -1}, "logprobs", "from 0 to 20"),
    ],
)
def test_bad_logprobs_requests_are_refused_naming_the_field(
    client, kind: str, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        if kind == "chat":
            client.chat.completions.create(model="gpt2", messages=MESSAGES, max_tokens=2, **extra)
        else:
            client.completions.create(model="gpt2", prompt="x", max_tokens=2, **extra)
    assert refused.value.param == param
    assert message in str(refused.value.body), refused.value.body
