"""Prefix caching seen by a client: usage's cached_tokens (openai SDK, whole and
streamed), the same tokens as without it, and the /metrics counters."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from conftest import ServerProcess
from gen_helpers import idle, wait_gen
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

# Long enough for a few blocks of 16 tokens, and said by no other test.
SYSTEM = (
    "You are the prefix-cache test's assistant. Answer in short sentences about "
    "rivers, stones and the weather, and never mention anything else at all."
)


async def counters(base: str, model: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        text = await r.text()
    got = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.name in (
                "aserve_cached_prompt_tokens_total",
                "aserve_prefix_cache_hits_total",
            ):
                got[sample.name] = sample.value
    return got


@pytest.mark.parametrize("model", ["gpt2", "llama"])
async def test_a_shared_system_prompt_is_cached(decoder_server: ServerProcess, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=decoder_server.base + "/v1", api_key="x", max_retries=0)
    before = await counters(decoder_server.base, model)

    def chat(user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    async def ask(user: str) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model=model, messages=chat(user), max_completion_tokens=8, temperature=0
        )

    first = await ask("Is it raining?")
    assert first.usage is not None and first.usage.prompt_tokens > 40
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = await ask("Is it raining?")  # the same prompt: all but its last block is cached
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert again.choices[0].message.content == first.choices[0].message.content

    stream = await client.chat.completions.create(
        model=model, messages=chat("And the rivers?"), max_completion_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 32 <= cached < usage.prompt_tokens  # the system prompt's blocks
    async with aiohttp.ClientSession() as s:
        await wait_gen(s, decoder_server.base, model, idle)
    after = await counters(decoder_server.base, model)
    hits = "aserve_prefix_cache_hits_total"
    tokens = "aserve_cached_prompt_tokens_total"
    assert after[hits] - before.get(hits, 0) == 2
    assert (
        after[tokens] - before.get(tokens, 0)
        == again.usage.prompt_tokens_details.cached_tokens + cached
    )
