"""Penalties, logit_bias and min_tokens on a real server (the openai SDK against
the tiny decoder models, their steps in a step process): each changes what is
generated as it says, bad values are refused naming the field, and the same
settings work over Triton's generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import tokenizers
from conftest import ServerProcess
from gen_helpers import EOS_PROMPT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(decoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)


def _greedy(client: openai.OpenAI, model: str = "gpt2", **extra: Any) -> Any:
    return client.completions.create(
        **{"model": model, "prompt": EOS_PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    )


def _tokenizer(decoder_models: dict[str, Any]) -> tokenizers.Tokenizer:
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    return tokenizers.Tokenizer.from_file(str(Path(gpt2["path"]) / "tokenizer.json"))


def test_logit_bias_forces_a_token_and_bans_another(client, decoder_models) -> None:
    tok = _tokenizer(decoder_models)
    forced = tok.encode(" hello").ids[0]
    answer = _greedy(client, max_tokens=6, logit_bias={str(forced): 100})
    assert answer.choices[0].text == tok.decode([forced] * 6)
    # Banned: the greedy continuation's first token never comes first again.
    first = _greedy(client, max_tokens=1).choices[0].text
    (first_id,) = tok.encode(first).ids
    banned = _greedy(client, max_tokens=1, logit_bias={str(first_id): -100})
    assert banned.choices[0].text != first


def test_penalties_change_a_greedy_continuation(client) -> None:
    plain = _greedy(client, max_tokens=24).choices[0].text
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},  # vLLM's field: not in the SDK's signature
    ):
        assert _greedy(client, max_tokens=24, **extra).choices[0].text != plain, extra
    # Zero penalties ask for nothing: the same text.
    same = _greedy(client, max_tokens=24, frequency_penalty=0, presence_penalty=0.0)
    assert same.choices[0].text == plain


def test_min_tokens_goes_past_the_end_token(client, decoder_models) -> None:
    ends = decoder_models["eos_tokens"]  # greedy decoding of EOS_PROMPT ends after these
    plain = _greedy(client, "gpt2-eos", max_tokens=40)
    assert (plain.usage.completion_tokens, plain.choices[0].finish_reason) == (ends, "stop")
    longer = _greedy(client, "gpt2-eos", max_tokens=40, extra_body={"min_tokens": ends + 4})
    assert longer.usage.completion_tokens >= ends + 4
    assert longer.choices[0].text.startswith(plain.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "must be a finite number from -2 to 2"),
        ({"frequency_penalty": "high"}, "frequency_penalty", "must be a finite number"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "in (0, 2]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "for token 5: must be a finite number"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "token id 999999 is out of range"),
        ({"logit_bias": [1]}, "logit_bias", "must be an object of token ids to biases"),
        ({"extra_body": {"min_tokens": 20}}, "min_tokens", "must be at most max_tokens (16)"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens", "must be an integer >= 0"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    client, extra: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _greedy(client, **extra)
    body = refused.value.body
    assert isinstance(body, dict)
    assert message in body["message"], body
    if "out of range" not in message:  # the engine's check names the field in its message
        assert refused.value.param == param


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_settings_work_over_tritons_generate(decoder_server, decoder_models) -> None:
    tok = _tokenizer(decoder_models)
    forced = tok.encode(" hello").ids[0]
    url = decoder_server.base + "/v2/models/gpt2/generate"
    body = {"text_input": EOS_PROMPT, "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(forced): 100}}  # fmt: skip
    status, doc = _post(url, body)
    assert (status, doc["text_output"]) == (200, tok.decode([forced] * 3)), doc
    status, doc = _post(url, {"text_input": EOS_PROMPT, "presence_penalty": 9})
    assert status == 400 and "presence_penalty" in doc["error"], doc
