"""The step process running ahead of the loop: the tokens a client sees are the
ones the step thread gives (which never runs ahead), whatever ends a stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import ServerProcess, start_server, write_config
from gen_helpers import GENERATION, gen_stats, idle, wait_gen

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello", "The quick brown fox", "server streams tokens", "many clients", "a"]


@pytest.fixture(scope="module")
def ahead(
    decoder_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """gpt2 three ways: the step process running ahead (the default), the step
    thread (the reference), and a step process with one slot."""
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    models = [
        {**gpt2, "name": "ahead", "generation": {**GENERATION, "step_run_ahead": 4}},
        {**gpt2, "name": "thread", "generation": {**GENERATION, "step_process": False}},
        {
            **gpt2,
            "name": "one",
            "generation": {**GENERATION, "max_num_seqs": 1, "step_run_ahead": 4},
        },
    ]
    srv = start_server(write_config(tmp_path_factory.mktemp("run-ahead"), {"models": models}))
    yield srv
    srv.stop()


async def stream(
    session: aiohttp.ClientSession, base: str, model: str, prompt: str, **fields: Any
) -> tuple[str, int, str | None]:
    """One streamed completion: its text, completion tokens and finish reason."""
    body = {"model": model, "prompt": prompt, "temperature": 0, "stream": True, **fields}
    body["stream_options"] = {"include_usage": True}
    text, tokens, reason = [], 0, None
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            doc = orjson.loads(line[6:])
            assert "error" not in doc, doc
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            for choice in doc["choices"]:
                text.append(choice["text"])
                reason = choice["finish_reason"] or reason
    return "".join(text), tokens, reason


async def both(session: aiohttp.ClientSession, base: str, cases: list[dict[str, Any]]) -> None:
    """``cases`` streamed together on each model: the same text, tokens and reasons."""
    got = {
        model: await asyncio.gather(*(stream(session, base, model, **c) for c in cases))
        for model in ("ahead", "thread")
    }
    assert got["ahead"] == got["thread"]


async def test_concurrent_greedy_streams_of_different_lengths_match(ahead: ServerProcess) -> None:
    base = ahead.base
    async with aiohttp.ClientSession() as session:
        before = (await gen_stats(session, base, "ahead"))["generation"]
        cases = [
            {"prompt": p, "max_tokens": 3 + 11 * i, "ignore_eos": True}
            for i, p in enumerate(PROMPTS)
        ]
        await both(session, base, [*cases, {"prompt": "Hello", "max_tokens": 1}])
        after = (await wait_gen(session, base, "ahead", idle))["generation"]
        thread = (await gen_stats(session, base, "thread"))["generation"]
    # The step process did run ahead; the step thread never does.
    assert after["ahead_step_count"] > before["ahead_step_count"]
    assert thread["ahead_step_count"] == 0


async def test_stop_strings_and_max_tokens_end_streams_at_the_same_token(
    ahead: ServerProcess,
) -> None:
    base = ahead.base
    async with aiohttp.ClientSession() as session:
        full = [await stream(session, base, "thread", p, max_tokens=40) for p in PROMPTS]
        cases = []
        for p, (text, _, _) in zip(PROMPTS, full, strict=True):
            # A stop string from the middle of the greedy text: the stream ends there.
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            cases.append({"prompt": p, "max_tokens": 40, "stop": [stop]})
            cases.append({"prompt": p, "max_tokens": 7})
        await both(session, base, cases)
        done = await asyncio.gather(*(stream(session, base, "ahead", **c) for c in cases[::2]))
        assert {reason for _, _, reason in done} == {"stop"}
        await wait_gen(session, base, "ahead", idle)


async def test_a_cancelled_stream_frees_the_only_slot_for_the_next(ahead: ServerProcess) -> None:
    base = ahead.base
    body = {"model": "one", "prompt": "Hello", "max_tokens": 120, "stream": True}
    body["ignore_eos"] = True
    async with aiohttp.ClientSession() as session:
        want = await stream(session, base, "thread", "The quick brown fox", max_tokens=20)
        before = await wait_gen(session, base, "one", idle)
        async with aiohttp.ClientSession() as streaming:
            r = await streaming.post(base + "/v1/completions", json=body)
            assert r.status == 200
            for _ in range(3):
                await r.content.readuntil(b"\n\n")
            # It runs ahead (nothing else is asked of it), holding the one slot.
            await wait_gen(
                session, base, "one",
                lambda s: s["generation"]["ahead_step_count"]
                > before["generation"]["ahead_step_count"],
            )  # fmt: skip
            r.close()  # the client goes away mid-stream
        # The next request gets the slot and the same tokens as ever.
        assert await stream(session, base, "one", "The quick brown fox", max_tokens=20) == want
        after = await wait_gen(session, base, "one", idle)
        assert after["cancelled"] == before["cancelled"] + 1
        made = after["generation"]["generated_tokens"] - before["generation"]["generated_tokens"]
        assert made < 120 + 20  # the cancelled one stopped early
