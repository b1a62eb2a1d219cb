"""vLLM's ``priority`` on a decoder model, through a real server and real clients.

One KV-cache slot and two places in the queue. The order of events is made,
never waited out: the step process is stopped (SIGSTOP) so that the step in
flight does not come back and the slot stays taken, and each arrival is
known queued when the model's statistics (``waiting_by_priority``) show it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from conftest import ServerProcess
from gen_helpers import idle, start_gpt2_server, wait_gen

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_gpt2_server(tmp_path_factory, "gen-priority", max_num_seqs=1, max_queue_size=2)
    yield s
    s.stop()


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


async def _complete(client: openai.AsyncOpenAI, priority: int | None, max_tokens: int = 4) -> str:
    extra = {"ignore_eos": True} if priority is None else {"ignore_eos": True, "priority": priority}
    r = await client.completions.create(
        model="gpt2", prompt="Hello there", max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return r.choices[0].text


def _waiting(want: dict[str, int]) -> Any:
    return lambda s: s["generation"]["waiting_by_priority"] == want


@asynccontextmanager
async def _slot_held(server: ServerProcess, session: aiohttp.ClientSession) -> AsyncIterator[Any]:
    """The one slot taken by a request whose step does not come back (the step
    process is stopped) until the block ends; yields that request's task."""
    base = server.base
    await wait_gen(session, base, "gpt2", idle)
    (child,) = server.spawned_children()
    child.suspend()
    try:
        hold = asyncio.create_task(_complete(_client(base), None))
        await wait_gen(session, base, "gpt2", lambda s: s["generation"]["running_sequence_count"])
        yield hold
    finally:
        child.resume()


async def test_the_more_urgent_request_is_admitted_first(server: ServerProcess) -> None:
    """Priority 5 queues first, priority 0 after it; once the slot frees, the
    priority-0 one runs (to its end: there is one slot) before the other starts."""
    base, client = server.base, _client(server.base)
    done: list[str] = []

    async def tracked(name: str, priority: int, max_tokens: int) -> str:
        text = await _complete(client, priority, max_tokens)
        done.append(name)
        return text

    async with aiohttp.ClientSession() as session:
        async with _slot_held(server, session) as hold:
            relaxed = asyncio.create_task(tracked("relaxed", 5, 8))
            await wait_gen(session, base, "gpt2", _waiting({"5": 1}))
            urgent = asyncio.create_task(tracked("urgent", 0, 4))
            await wait_gen(session, base, "gpt2", _waiting({"0": 1, "5": 1}))
        texts = await asyncio.gather(hold, urgent, relaxed)
        await wait_gen(session, base, "gpt2", idle)
    # The relaxed one could start only when the urgent one had ended.
    assert done == ["urgent", "relaxed"]
    assert all(texts)


async def test_a_full_queue_gives_a_more_urgent_arrival_the_least_urgent_place(
    server: ServerProcess,
) -> None:
    base, client = server.base, _client(server.base)
    async with aiohttp.ClientSession() as session:
        async with _slot_held(server, session) as hold:
            first = asyncio.create_task(_complete(client, 5))
            await wait_gen(session, base, "gpt2", _waiting({"5": 1}))
            second = asyncio.create_task(_complete(client, 5))
            await wait_gen(session, base, "gpt2", _waiting({"5": 2}))
            # Full: priority 0 takes the place of the one that would go last.
            urgent = asyncio.create_task(_complete(client, 0))
            with pytest.raises(openai.RateLimitError) as displaced:
                await second
            await wait_gen(session, base, "gpt2", _waiting({"0": 1, "5": 1}))
            message = displaced.value.body["message"]  # type: ignore[index]
            assert "(priority 0) took the place of this one (priority 5" in message, message
            # Priority 5 finds only as urgent ones to push out: refused, as with no priorities.
            with pytest.raises(openai.RateLimitError, match="none less urgent than this one's"):
                await _complete(client, 5)
            again = asyncio.create_task(_complete(client, 0))
            with pytest.raises(openai.RateLimitError, match="took the place"):
                await first
            await wait_gen(session, base, "gpt2", _waiting({"0": 2}))
            # A queue of priority 0: priority 5 and priority 0 are refused (the
            # latter as with no priorities: none is in use, none is named).
            for priority, says in ((5, "none less urgent than this one's priority 5"),
                                   (0, "waiting for a slot and 0 being prepared")):  # fmt: skip
                with pytest.raises(openai.RateLimitError) as refused:
                    await _complete(client, priority)
                assert refused.value.response.headers.get("Retry-After") == "1"
                assert says in str(refused.value) and "max_queue_size 2" in str(refused.value)
        assert all(await asyncio.gather(hold, urgent, again))
        stats = await wait_gen(session, base, "gpt2", idle)
    assert stats["generation"]["waiting_by_priority"] == {}


BAD = ["high", 1.5, True, 2**40, -(2**31) - 1, [0], {"level": 0}]


async def test_a_priority_that_is_no_int32_is_refused_naming_it(server: ServerProcess) -> None:
    base = server.base
    async with aiohttp.ClientSession() as session:
        for path, body in (
            ("/v1/completions", {"model": "gpt2", "prompt": "hi", "max_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": "gpt2", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 2},
            ),
        ):  # fmt: skip
            for value in BAD:
                async with session.post(base + path, json={**body, "priority": value}) as r:
                    doc = await r.json()
                assert r.status == 400, (path, value, doc)
                assert doc["error"]["param"] == "priority", (path, value, doc)
                assert doc["error"]["message"].startswith("priority: must be an integer"), doc
            # The bounds themselves, a negative one and null (the default) are taken.
            for value in (-(2**31), 2**31 - 1, -7, None):
                async with session.post(base + path, json={**body, "priority": value}) as r:
                    assert r.status == 200, (path, value, await r.text())
        # Triton's generate extension and KServe /infer take it as a parameter.
        gen = base + "/v2/models/gpt2/generate"
        infer_body = {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
        }
        for value in ("high", 1.5, True, 2**40):
            async with session.post(
                gen, json={"text_input": "hi", "parameters": {"max_tokens": 2, "priority": value}}
            ) as r:
                doc = await r.json()
            assert r.status == 400 and "parameter 'priority' must be an integer" in doc["error"]
            params = {"max_tokens": 2, "priority": value}
            async with session.post(
                base + "/v2/models/gpt2/infer", json={**infer_body, "parameters": params}
            ) as r:
                doc = await r.json()
            assert r.status == 400 and "parameter 'priority'" in doc["error"], doc
        async with session.post(
            gen, json={"text_input": "hi", "max_tokens": 2, "priority": -3}
        ) as r:
            assert r.status == 200, await r.text()
    # The SDK's own error carries the field too.
    with pytest.raises(openai.BadRequestError) as exc:
        await _complete(_client(base), 1.5)  # type: ignore[arg-type]
    assert exc.value.param == "priority"
