"""Generation through a real server: continuous batching, cancellation, gRPC, Triton's APIs."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import numpy as np
import openai
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ServerProcess
from gen_helpers import gen_stats, idle, wait_gen
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc

pytestmark = pytest.mark.timeout(60)

WORDS = "the quick brown fox jumps over lazy dog server streams tokens to many clients".split()


def completion_text(base: str, model: str, prompt: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


async def test_16_concurrent_streams_complete_in_shared_steps(
    decoder_server: ServerProcess,
) -> None:
    base = decoder_server.base
    prompts = [" ".join(WORDS[i % 7 : i % 7 + 2 + i % 5]) for i in range(16)]
    budgets = [8 + (i * 5) % 17 for i in range(16)]  # sequences leave at different steps
    wanted = [
        await asyncio.to_thread(completion_text, base, "llama", p, n)
        for p, n in zip(prompts, budgets, strict=True)
    ]
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as session:
        before = (await gen_stats(session, base, "llama"))["generation"]

        async def one(prompt: str, n: int) -> tuple[str, str | None]:
            stream = await client.completions.create(
                model="llama", prompt=prompt, max_tokens=n, temperature=0, stream=True
            )
            pieces, reason = [], None
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason
            return "".join(pieces), reason

        results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, budgets, strict=True)))
        assert [t for t, _ in results] == wanted
        assert {r for _, r in results} == {"length"}
        after = (await wait_gen(session, base, "llama", idle))["generation"]
    sizes = {
        int(k): v - before["step_batch_sizes"].get(k, 0)
        for k, v in after["step_batch_sizes"].items()
    }
    # Continuous batching: steps ran many sequences at once (8 slots, 16 streams).
    assert max(k for k, v in sizes.items() if v > 0) > 4
    assert after["generated_tokens"] - before["generated_tokens"] == sum(budgets)
    assert after["step_count"] - before["step_count"] < sum(budgets) / 3


async def test_client_that_disconnects_mid_stream_frees_its_slot(
    decoder_server: ServerProcess,
) -> None:
    base = decoder_server.base
    body = {
        "model": "gpt2",
        "prompt": "Hello",
        "max_tokens": 120,
        "stream": True,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as session:
        before = await wait_gen(session, base, "gpt2", idle)
        async with aiohttp.ClientSession() as streaming:
            r = await streaming.post(base + "/v1/completions", json=body)
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            await r.content.readuntil(b"\n\n")
            running = await gen_stats(session, base, "gpt2")
            assert running["generation"]["running_sequence_count"] == 1
            r.close()  # the client goes away mid-stream
        after = await wait_gen(session, base, "gpt2", idle)
        assert after["cancelled"] == before["cancelled"] + 1
        made = after["generation"]["generated_tokens"] - before["generation"]["generated_tokens"]
        assert 2 <= made < 120  # it stopped early: the sequence left the batch


async def test_grpc_generate_streams_tokens_incrementally(decoder_server: ServerProcess) -> None:
    want = await asyncio.to_thread(completion_text, decoder_server.base, "llama", "Hello world", 20)
    async with grpc.aio.insecure_channel(decoder_server.grpc_url) as channel:
        stub = apb_grpc.GenerationStub(channel)
        request = apb.GenerateRequest(
            model_name="llama", prompt="Hello world", id="g1",
            sampling=apb.SamplingParameters(max_tokens=20, temperature=0),
        )  # fmt: skip
        messages = [m async for m in stub.Generate(request)]
    assert len(messages) > 5  # one per step while the reader keeps up
    assert "".join(m.text for m in messages) == want
    assert sum(len(m.token_ids) for m in messages) == 20
    assert all(m.id == "g1" for m in messages)
    assert [m.finish_reason for m in messages[:-1]] == [apb.FINISH_REASON_UNSPECIFIED] * (
        len(messages) - 1
    )
    last = messages[-1]
    assert last.finish_reason == apb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 20
    assert last.usage.total_tokens == last.usage.prompt_tokens + 20


async def test_grpc_generate_errors_and_chat(decoder_server: ServerProcess) -> None:
    async with grpc.aio.insecure_channel(decoder_server.grpc_url) as channel:
        stub = apb_grpc.GenerationStub(channel)
        for request, code, text in [
            (apb.GenerateRequest(model_name="nope", prompt="x"), grpc.StatusCode.NOT_FOUND, "nope"),
            (
                apb.GenerateRequest(model_name="llama"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "exactly one",
            ),
            (
                apb.GenerateRequest(
                    model_name="llama", prompt="x", sampling=apb.SamplingParameters(max_tokens=500)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_tokens",
            ),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(request):
                    pass
            assert exc.value.code() == code and text in (exc.value.details() or "")
        chat = apb.GenerateRequest(
            model_name="llama", messages=[apb.ChatMessage(role="user", content="Hello")],
            sampling=apb.SamplingParameters(max_tokens=3, temperature=0),
        )  # fmt: skip
        messages = [m async for m in stub.Generate(chat)]
        assert messages[-1].usage.completion_tokens <= 3 and messages[-1].finish_reason != 0


async def test_grpc_cancel_frees_the_slot(decoder_server: ServerProcess) -> None:
    base = decoder_server.base
    async with aiohttp.ClientSession() as session:
        before = await wait_gen(session, base, "gpt2", idle)
        async with grpc.aio.insecure_channel(decoder_server.grpc_url) as channel:
            stub = apb_grpc.GenerationStub(channel)
            call = stub.Generate(
                apb.GenerateRequest(
                    model_name="gpt2", prompt="Hello",
                    sampling=apb.SamplingParameters(max_tokens=120, ignore_eos=True),
                )
            )  # fmt: skip
            first = await call.read()
            second = await call.read()
            assert len(first.token_ids) + len(second.token_ids) >= 2
            running = await gen_stats(session, base, "gpt2")
            assert running["generation"]["running_sequence_count"] == 1
            call.cancel()
            after = await wait_gen(session, base, "gpt2", idle)
        assert after["cancelled"] == before["cancelled"] + 1
        made = after["generation"]["generated_tokens"] - before["generation"]["generated_tokens"]
        assert 2 <= made < 120


def stream_infer_sync(url: str, requests: list[dict]) -> dict[str, list]:
    """ModelStreamInfer through tritonclient.grpc's stream API; results by request id."""
    by_id: dict[str, list] = {r["request_id"]: [] for r in requests}
    errors: list = []
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(
            lambda result, error: (
                errors.append(error) if error else by_id[result.get_response().id].append(result)
            )
        )
        for r in requests:
            client.async_stream_infer(**r)
        client.stop_stream()  # half-close: returns once the server has answered everything
    finally:
        client.close()
    assert errors == []
    return by_id


async def test_decoupled_model_stream_infer(decoder_server: ServerProcess) -> None:
    want = await asyncio.to_thread(completion_text, decoder_server.base, "llama", "Hello", 12)
    requests = []
    for i, empty_final in enumerate([False, True]):
        inp = grpcclient.InferInput("text_input", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"Hello"], dtype=object))
        requests.append({
            "model_name": "llama", "inputs": [inp], "request_id": f"r{i}",
            "parameters": {"max_tokens": 12, "temperature": 0},
            "enable_empty_final_response": empty_final,
        })  # fmt: skip
    by_id = await asyncio.to_thread(stream_infer_sync, decoder_server.grpc_url, requests)
    for rid, results in by_id.items():
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
        assert finals == [False] * (len(results) - 1) + [True]
        texts = [r.as_numpy("text_output") for r in results]
        if rid == "r1":  # the empty final response has no outputs
            assert texts[-1] is None
            texts = texts[:-1]
        assert len(texts) > 3
        assert b"".join(t[0] for t in texts).decode() == want
    last = by_id["r0"][-1].get_response().parameters
    assert (
        last["finish_reason"].string_param == "length"
        and last["completion_tokens"].int64_param == 12
    )


async def test_triton_generate_and_generate_stream(decoder_server: ServerProcess) -> None:
    base = decoder_server.base
    want = await asyncio.to_thread(completion_text, base, "gpt2", "Hello", 10)
    body = {"id": "t1", "text_input": "Hello", "parameters": {"temperature": 0}, "max_tokens": 10}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v2/models/gpt2/generate", json=body) as r:
            assert r.status == 200
            doc = await r.json()
        assert doc["text_output"] == want and doc["id"] == "t1"
        assert (doc["model_name"], doc["model_version"], doc["finish_reason"]) == (
            "gpt2",
            "1",
            "length",
        )
        async with session.post(
            base + "/v2/models/gpt2/versions/1/generate_stream", json=body
        ) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
        events = [orjson.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]
        assert len(events) > 2 and b"[DONE]" not in raw
        assert "".join(e["text_output"] for e in events) == want
        assert events[-1]["usage"]["completion_tokens"] == 10
        body["exclude_input_in_output"] = False
        async with session.post(base + "/v2/models/gpt2/generate", json=body) as r:
            assert (await r.json())["text_output"] == "Hello" + want
        for url, payload, status, message in [
            ("/v2/models/gpt2/generate", {"parameters": {}}, 400, "text_input"),
            (
                "/v2/models/gpt2/generate_stream",
                {"text_input": "x", "temperature": "hot"},
                400,
                "temperature",
            ),
            ("/v2/models/nope/generate", {"text_input": "x"}, 404, "nope"),
        ]:
            async with session.post(base + url, json=payload) as r:
                assert r.status == status
                assert message in (await r.json())["error"]
        # A bad timeout parameter is refused even when the header would override it.
        bad_timeout = {"text_input": "x", "parameters": {"timeout_ms": "soon"}}
        async with session.post(
            base + "/v2/models/gpt2/generate",
            json=bad_timeout,
            headers={"aserve-timeout-ms": "500"},
        ) as r:
            assert r.status == 400
            assert "timeout_ms" in (await r.json())["error"]


async def test_kserve_infer_metadata_and_config(decoder_server: ServerProcess) -> None:
    base = decoder_server.base
    want = await asyncio.to_thread(completion_text, base, "llama", "Hello", 6)
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hello"]}],
        "parameters": {"max_tokens": 6, "temperature": 0},
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v2/models/llama/infer", json=body) as r:
            assert r.status == 200
            [out] = (await r.json())["outputs"]
        assert (out["name"], out["datatype"], out["data"]) == ("text_output", "BYTES", [want])
        async with session.get(base + "/v2/models/llama") as r:
            meta = await r.json()
        assert meta["platform"] == "aserve_decoder"
        assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [1]}]
    client = grpcclient.InferenceServerClient(decoder_server.grpc_url)
    try:
        config = client.get_model_config("llama", as_json=True)["config"]
        assert config["model_transaction_policy"] == {"decoupled": True}
        # Over HTTP, the same config (gRPC's JSON writes 64-bit integers as strings).
        http_client = httpclient.InferenceServerClient(decoder_server.url)
        http_config = http_client.get_model_config("llama")
        http_client.close()
        assert http_config["model_transaction_policy"] == {"decoupled": True}
        assert json_format.ParseDict(http_config, model_config_pb2.ModelConfig()) == (
            json_format.ParseDict(config, model_config_pb2.ModelConfig())
        )
        assert config["max_batch_size"] == 0 if "max_batch_size" in config else True
    finally:
        client.close()
