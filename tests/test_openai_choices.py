"""n choices and best_of over the OpenAI API on a real server (the openai SDK
against the tiny decoders): each choice its own index and its own seed
(seed, seed + 1, ...), streams interleaving the choices, usage counting the
prompt once and every choice's tokens, best_of keeping the most likely."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from conftest import ServerProcess

pytestmark = pytest.mark.timeout(120)

SAMPLED = {"temperature": 1.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def _completion(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(**{"model": "gpt2", "prompt": "The sea", **SAMPLED, **extra})


def test_n_choices_each_have_an_index_and_the_next_seed(client) -> None:
    answer = _completion(client, n=3, seed=5)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    alone = [_completion(client, seed=5 + i).choices[0].text for i in range(3)]
    assert [c.text for c in answer.choices] == alone
    assert len(set(alone)) > 1  # the seeds really differ
    one = _completion(client, seed=5)
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens
    assert answer.usage.completion_tokens == 3 * 8
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 24


def test_a_streamed_chat_interleaves_its_choices(client) -> None:
    args = {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}], "n": 2,
            "seed": 9, **SAMPLED}  # fmt: skip
    whole = client.chat.completions.create(**args)
    texts: dict[int, str] = {0: "", 1: ""}
    roles, finishes, usage = [], [], None
    for chunk in client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append((choice.index, choice.finish_reason))
    assert sorted(roles) == [0, 1]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage is not None and usage.completion_tokens == 16 == whole.usage.completion_tokens


def test_best_of_keeps_the_most_likely_choices(client) -> None:
    every = _completion(client, n=4, seed=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    ranked = [every.choices[i].text for i in sorted(range(4), key=lambda i: -scores[i])]
    best = _completion(client, n=2, best_of=4, seed=3)
    assert [c.text for c in best.choices] == ranked[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: not shown
    assert best.usage.completion_tokens == 4 * 8  # every choice generated counts
