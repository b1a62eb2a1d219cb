"""Chunked prefill through a real server (step process, step thread, a step
process that runs ahead of the server): long
prompts prefilled a few tokens a step give the same answers, whole and
streamed, as the same model prefilling them whole."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from conftest import ServerProcess
from gen_helpers import gen_stats, idle, start_gpt2_server, wait_gen

pytestmark = pytest.mark.timeout(90)

LONG = " ".join(f"river {i} by stone," for i in range(10))  # about 70 tokens


@pytest.fixture(
    scope="module",
    params=[(True, 0), (False, 0), (True, 4)],
    ids=["step-process", "step-thread", "run-ahead"],
)
def chunked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process, ahead = request.param
    s = start_gpt2_server(
        tmp_path_factory,
        "chunked",
        max_num_batched_tokens=8,
        step_process=process,
        step_run_ahead=ahead,
    )
    yield s
    s.stop()


async def answers(base: str) -> tuple[list[str], int]:
    """Three streams: two short prompts and the long one arriving with them."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str) -> tuple[str, int]:
        stream = await client.completions.create(
            model="gpt2", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[
            -1
        ].usage.prompt_tokens

    got = await asyncio.gather(one("Hello there"), one(LONG), one("seven silver"))
    return [t for t, _ in got], got[1][1]


async def test_chunked_answers_equal_whole_prefill(
    chunked: ServerProcess, decoder_server: ServerProcess
) -> None:
    async with aiohttp.ClientSession() as s:
        before = (await gen_stats(s, chunked.base, "gpt2"))["generation"]["step_count"]
    got, long_tokens = await answers(chunked.base)
    want, _ = await answers(decoder_server.base)
    assert got == want and all(len(t) > 3 for t in got)
    async with aiohttp.ClientSession() as s:
        after = await wait_gen(s, chunked.base, "gpt2", idle)
    # 12 tokens each, and the long prompt's prefill at most 8 tokens a step.
    assert long_tokens > 60
    assert after["generation"]["step_count"] - before >= 11 + long_tokens // 8
