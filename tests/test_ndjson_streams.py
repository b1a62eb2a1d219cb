"""Accept: application/x-ndjson on the HTTP token streams, read with a plain chunked reader.

The reader is a raw socket that decodes the chunked transfer encoding itself
and splits the body into lines: what a GRPS-style client does.
"""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import Iterator
from typing import Any

import aiohttp
import lm_models
import orjson
import pytest
from conftest import ServerProcess, start_server, write_config
from gen_helpers import GENERATION, gen_stats, idle, wait_gen
from helpers import frozen

from aserve.frontends.http.stream import wants_ndjson

pytestmark = pytest.mark.timeout(90)

NDJSON = "application/x-ndjson"


async def _chunked_lines(
    port: int, path: str, doc: Any, accept: str = NDJSON, headers: str = ""
) -> tuple[int, dict[str, str], list[bytes]]:
    """POST ``doc``; the status, the headers and the body's lines, read chunk by chunk."""
    body = orjson.dumps(doc)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAccept: {accept}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{headers}"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        head: dict[str, str] = {}
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            head[name.strip().lower()] = value.strip()
        if head.get("transfer-encoding") != "chunked":
            return status, head, [await reader.readexactly(int(head["content-length"]))]
        data = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                assert await reader.readline() == b"\r\n"  # no trailers
                break
            data += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
        assert data.endswith(b"\n"), data[-200:]
        return status, head, data[:-1].split(b"\n")
    finally:
        writer.close()


async def test_generate_stream_as_ndjson(decoder_server: ServerProcess) -> None:
    doc = {"text_input": "Hello world", "parameters": {"max_tokens": 10, "temperature": 0}}
    status, head, lines = await _chunked_lines(
        decoder_server.port, "/v2/models/gpt2/generate_stream", doc
    )
    assert status == 200
    assert head["content-type"] == NDJSON
    assert head["transfer-encoding"] == "chunked"
    docs = [orjson.loads(line) for line in lines]  # every line is one JSON object
    assert len(docs) >= 2 and all(d["model_name"] == "gpt2" for d in docs)
    assert docs[-1]["finish_reason"] == "length" and docs[-1]["usage"]["completion_tokens"] == 10
    async with aiohttp.ClientSession() as session:
        async with session.post(
            decoder_server.base + "/v2/models/gpt2/generate", json=doc
        ) as r:  # fmt: skip
            whole = await r.json()
    assert "".join(d["text_output"] for d in docs) == whole["text_output"]
    # Without the header (or preferring SSE) the same route speaks SSE.
    for accept in ("*/*", f"text/event-stream, {NDJSON}"):
        status, head, lines = await _chunked_lines(
            decoder_server.port, "/v2/models/gpt2/generate_stream", doc, accept
        )
        assert head["content-type"].startswith("text/event-stream")
        assert lines[0].startswith(b"data: {")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_openai_stream_as_ndjson(decoder_server: ServerProcess, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    doc: dict[str, Any] = {"model": "gpt2", "max_tokens": 8, "temperature": 0}
    if chat:
        doc["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        doc["prompt"] = "Hello"
    streamed = {**doc, "stream": True, "stream_options": {"include_usage": True}}
    status, head, lines = await _chunked_lines(decoder_server.port, path, streamed)
    assert (status, head["content-type"]) == (200, NDJSON)
    assert b"[DONE]" not in b"".join(lines)
    docs = [orjson.loads(line) for line in lines]
    *chunks, last = docs
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    async with aiohttp.ClientSession() as session:
        async with session.post(decoder_server.base + path, json=doc) as r:
            whole = (await r.json())["choices"][0]
    assert text == (whole["message"]["content"] if chat else whole["text"])


async def test_failure_after_the_first_byte_is_a_last_error_line(
    decoder_server: ServerProcess,
) -> None:
    # A 1 ms deadline passes after the stream started (as the SSE test has it).
    long = "aserve-timeout-ms: 1\r\n"
    gen = {"text_input": "Hello", "parameters": {"max_tokens": 120, "ignore_eos": True}}
    status, head, lines = await _chunked_lines(
        decoder_server.port, "/v2/models/gpt2/generate_stream", gen, headers=long
    )
    assert (status, head["content-type"]) == (200, NDJSON)
    assert "timed out" in orjson.loads(lines[-1])["error"]
    chat = {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120,
            "ignore_eos": True, "stream": True}  # fmt: skip
    status, head, lines = await _chunked_lines(
        decoder_server.port, "/v1/chat/completions", chat, headers=long
    )
    assert (status, head["content-type"]) == (200, NDJSON)
    error = orjson.loads(lines[-1])["error"]
    assert error["type"] == "timeout_error" and "timed out" in error["message"]
    # Refusals before the first byte are plain JSON answers with their status.
    status, head, [body] = await _chunked_lines(
        decoder_server.port, "/v2/models/gpt2/generate_stream", {"text_input": 5}
    )
    assert (status, head["content-type"]) == (400, "application/json")
    assert orjson.loads(body) == {"error": "field 'text_input' must be a string"}
    async with aiohttp.ClientSession() as session:
        await wait_gen(session, decoder_server.base, "gpt2", idle)


async def test_a_client_that_goes_away_cancels_its_sequence(decoder_server: ServerProcess) -> None:
    base = decoder_server.base
    body = {"text_input": "Hello", "parameters": {"max_tokens": 120, "ignore_eos": True}}
    async with aiohttp.ClientSession() as session:
        before = await wait_gen(session, base, "gpt2", idle)
        async with aiohttp.ClientSession() as streaming:
            r = await streaming.post(
                base + "/v2/models/gpt2/generate_stream", json=body, headers={"Accept": NDJSON}
            )
            assert r.status == 200 and r.content_type == NDJSON
            orjson.loads(await r.content.readline())
            orjson.loads(await r.content.readline())
            running = await gen_stats(session, base, "gpt2")
            assert running["generation"]["running_sequence_count"] == 1
            r.close()  # the client goes away mid-stream
        after = await wait_gen(session, base, "gpt2", idle)
        assert after["cancelled"] == before["cancelled"] + 1
        made = after["generation"]["generated_tokens"] - before["generation"]["generated_tokens"]
        assert 2 <= made < 120  # it stopped early: the sequence left the batch


async def test_body_limit_applies_before_reading(decoder_server: ServerProcess) -> None:
    """A body declared over the generation limit is refused before it is sent, NDJSON or not."""
    for path in ("/v2/models/gpt2/generate_stream", "/v1/chat/completions"):
        reader, writer = await asyncio.open_connection("127.0.0.1", decoder_server.port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAccept: {NDJSON}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n".encode()
            )
            status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
            assert status == 413, path
        finally:
            writer.close()


def test_http_client_reads_the_stream_line_by_line(decoder_server: ServerProcess) -> None:
    """The stdlib's client, which undoes the chunking, reads one object per readline()."""
    conn = http.client.HTTPConnection("127.0.0.1", decoder_server.port, timeout=30)
    try:
        conn.request(
            "POST", "/v2/models/gpt2/generate_stream",
            orjson.dumps({"text_input": "Hi", "max_tokens": 5, "temperature": 0}),
            {"Accept": NDJSON, "Content-Type": "application/json"},
        )  # fmt: skip
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked"
        docs = []
        while line := r.readline():
            docs.append(orjson.loads(line))
        assert docs[-1]["usage"]["completion_tokens"] == 5
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("accept", "ndjson"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("text/event-stream", False),
        (NDJSON, True),
        (f"{NDJSON}; charset=utf-8", True),
        (f"text/event-stream, {NDJSON}", False),
        (f"{NDJSON}, text/event-stream", True),
        (f"text/event-stream;q=0.5, {NDJSON}", True),
        (f"{NDJSON};q=0", False),
        (f"{NDJSON};q=nan", False),
        (f"{NDJSON};q=junk, text/event-stream", False),
    ],
)
def test_accept_chooses_the_framing(accept: str | None, ndjson: bool) -> None:
    assert wants_ndjson(accept) is ndjson


# --- limits.max_concurrency: a stream holds its slot while it streams ------------------


@pytest.fixture(scope="module")
def one_stream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny gpt2 alone, with room for one inference request and two connections."""
    gpt2 = lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    folder = tmp_path_factory.mktemp("ndjson-limits")
    model = {"name": "gpt2", "engine": "decoder", "path": str(gpt2), "generation": GENERATION}
    limits = {"max_concurrency": 1, "max_connections": 2}
    srv = start_server(write_config(folder, {"limits": limits, "models": [model]}))
    yield srv
    srv.stop()


async def _kept_alive(port: int, path: str) -> asyncio.StreamWriter:
    """A connection that has been answered ``GET path`` and stays open (keep-alive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    assert int((await reader.readline()).split()[1]) == 200
    length = 0
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        length = int(value) if name.lower() == "content-length" else length
    await reader.readexactly(length)
    return writer


async def test_an_ndjson_stream_counts_under_the_limits(one_stream: ServerProcess) -> None:
    """While one NDJSON stream is open (its step process held stopped, so it cannot end
    early), the next stream on either route is refused at once: 429 and plain JSON, by
    limits.max_concurrency; with one more connection open, by limits.max_connections."""
    base = one_stream.base
    (step_process,) = one_stream.spawned_children()
    held = {"text_input": "Hello", "parameters": {"max_tokens": 100, "ignore_eos": True}}
    chat = {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "stream": True}  # fmt: skip
    limit = "server is serving 1 requests, its limit limits.max_concurrency is 1; retry later"
    # No loop watchdog here: its probes' connection would count under max_connections.
    async with aiohttp.ClientSession() as session:
        r = await session.post(
            base + "/v2/models/gpt2/generate_stream", json=held, headers={"Accept": NDJSON}
        )
        assert r.status == 200 and r.content_type == NDJSON
        orjson.loads(await r.content.readline())  # streaming: it holds the slot
        with frozen(step_process.pid):
            refused = [("/v2/models/gpt2/generate_stream", held), ("/v1/chat/completions", chat)]
            for path, doc in refused:
                status, head, [body] = await _chunked_lines(one_stream.port, path, doc)
                assert (status, head["content-type"]) == (429, "application/json"), body
                assert head["retry-after"] == "1"
                error = orjson.loads(body)["error"]
                assert (error if isinstance(error, str) else error["message"]) == limit
            # The stream's connection and a kept-alive one are two: a third is refused.
            other = await _kept_alive(one_stream.port, "/v2/models/gpt2/config")
            for path, doc in refused:
                status, head, [body] = await _chunked_lines(one_stream.port, path, doc)
                assert (status, head["content-type"]) == (429, "application/json"), body
                error = orjson.loads(body)["error"]
                message = error if isinstance(error, str) else error["message"]
                assert "its limit limits.max_connections is 2" in message, message
            other.close()
        r.close()  # the held stream goes: its slot is free once the server has seen it
    # Served again once the server has seen both connections go (until then, 429).
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        status, head, lines = await _chunked_lines(one_stream.port, "/v1/chat/completions", chat)
        if status == 200 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert (status, head["content-type"]) == (200, NDJSON)
    assert orjson.loads(lines[-1])["choices"][0]["finish_reason"] == "length"
    async with aiohttp.ClientSession() as session:
        await wait_gen(session, base, "gpt2", idle)  # the held sequence was cancelled
