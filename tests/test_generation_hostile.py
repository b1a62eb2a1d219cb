"""Hostile generation requests on a real server: one request never hurts another.

Attackers send sampling settings past their bounds on every generation route
(OpenAI completions and chat, Triton generate, KServe ``/infer``, gRPC
``ModelInfer`` parameters and ``Generate``) while greedy victims stream beside
them in the same engine steps. Each attacker gets a 400 / ``INVALID_ARGUMENT``
naming the setting; every victim completes, with the text it gets alone; the
event loop never stalls (``stall_watch``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess
from gen_helpers import idle, start_gpt2_server, wait_gen
from stall_watch import watch_loop

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

VICTIMS = 6
ROUNDS = 3
VICTIM_TOKENS = 24


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_gpt2_server(tmp_path_factory, "gen-hostile")
    yield server
    server.stop()


# --- attackers: (route, body or request, the setting the refusal must name) ---------------

HUGE = 2**63
HTTP_ATTACKS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"model": "gpt2", "prompt": "Hi", "top_k": HUGE}, "top_k"),
    ("/v1/completions", {"model": "gpt2", "prompt": "Hi", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"model": "gpt2", "prompt": "Hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": "gpt2", "prompt": "Hi", "stop": ["x" * 5000]}, "stop"),
    (
        "/v1/chat/completions",
        {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}], "top_k": HUGE},
        "top_k",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "gpt2",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "max_completion_tokens": HUGE,
        },
        "max_completion_tokens",
    ),
    ("/v2/models/gpt2/generate", {"text_input": "Hi", "parameters": {"top_k": HUGE}}, "top_k"),
    ("/v2/models/gpt2/generate_stream", {"text_input": "Hi", "top_k": HUGE}, "top_k"),
    ("/v2/models/gpt2/generate", {"text_input": "Hi", "seed": 2**64 + 1}, "seed"),
    ("/v2/models/gpt2/generate", {"text_input": "Hi", "temperature": 1e308}, "temperature"),
    ("/v2/models/gpt2/generate", {"text_input": "Hi", "max_tokens": HUGE}, "max_tokens"),
    (
        "/v2/models/gpt2/infer",
        {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]}],
            "parameters": {"top_k": HUGE},
        },
        "top_k",
    ),
]


def _infer_request(params: dict[str, pb.InferParameter]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="gpt2")
    tensor = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"Hi")
    for key, value in params.items():
        req.parameters[key].CopyFrom(value)
    return req


GRPC_INFER_ATTACKS: list[tuple[pb.ModelInferRequest, str]] = [
    (_infer_request({"top_k": pb.InferParameter(uint64_param=HUGE)}), "top_k"),
    (_infer_request({"temperature": pb.InferParameter(double_param=math.nan)}), "temperature"),
    (_infer_request({"top_p": pb.InferParameter(double_param=math.inf)}), "top_p"),
    (_infer_request({"seed": pb.InferParameter(int64_param=-1)}), "seed"),
]
GRPC_GENERATE_ATTACKS: list[tuple[apb.SamplingParameters, str]] = [
    (apb.SamplingParameters(temperature=math.nan), "temperature"),
    (apb.SamplingParameters(temperature=-math.inf), "temperature"),
    (apb.SamplingParameters(top_p=math.nan), "top_p"),
    (apb.SamplingParameters(top_k=2**32 - 1), "top_k"),
]


async def _victim(session: aiohttp.ClientSession, base: str, prompt: str) -> str:
    body = {"model": "gpt2", "prompt": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = []
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                doc = orjson.loads(line[6:])
                assert "error" not in doc, f"a victim failed: {doc}"
                text.append(doc["choices"][0]["text"])
    return "".join(text)


async def _http_attacker(session: aiohttp.ClientSession, base: str) -> None:
    for path, body, name in HTTP_ATTACKS:
        async with session.post(base + path, json=body) as r:
            text = await r.text()
            assert r.status == 400, f"{path} {body}: {r.status} {text[:300]}"
            assert name in text, f"{path}: the refusal does not name {name}: {text[:300]}"


async def _grpc_attacker(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel)
        for request, name in GRPC_INFER_ATTACKS:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await infer.ModelInfer(request)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            assert name in (exc.value.details() or "")
        generate = apb_grpc.GenerationStub(channel)
        for sampling, name in GRPC_GENERATE_ATTACKS:
            request = apb.GenerateRequest(model_name="gpt2", prompt="Hi", sampling=sampling)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in generate.Generate(request):
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
            assert name in (exc.value.details() or "")


async def test_out_of_bound_settings_are_refused_and_never_fail_a_neighbour(
    srv: ServerProcess,
) -> None:
    prompts = [f"victim number {i} says" for i in range(VICTIMS)]
    async with aiohttp.ClientSession() as session:
        alone = [await _victim(session, srv.base, p) for p in prompts]
        async with watch_loop(srv.base):
            for _ in range(ROUNDS):
                results = await asyncio.gather(
                    *(_victim(session, srv.base, p) for p in prompts),
                    _http_attacker(session, srv.base),
                    _http_attacker(session, srv.base),
                    _grpc_attacker(srv.grpc_url),
                )
                assert results[:VICTIMS] == alone
    assert "Traceback" not in srv.log_text()


# --- prompts too large to tokenize --------------------------------------------------------

BIG = 20 * 2**20  # bytes of text: under limits.max_request_bytes, far over max_prompt_bytes
BIG_IDS = 2_000_000
RSS_SLACK = 384 * 2**20  # allocator caches; before, one 30 MB prompt kept ~4 GB
ROUNDS_BIG = 3


def _big_http() -> list[tuple[str, Any, int, str]]:
    """Bodies far over the generation body limit (refused before parsing), and
    bodies under it whose prompt is over its own limits (refused before tokenizing)."""
    text = "word " * (BIG // 5)
    ids = [1000 + i % 1000 for i in range(BIG_IDS)]  # no small-int cache: real objects
    # KServe JSON tensors are decoded before the model sees them (not this test's case).
    tensor = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text[: 2**20]]}
    body = "max_prompt_bytes"
    over = "é" * 2100  # 4200 bytes: over the 4096 of max_model_len 128, under the body limit
    return [
        ("/v1/completions", {"model": "gpt2", "prompt": text}, 413, body),
        ("/v1/completions", {"model": "gpt2", "prompt": ids}, 413, body),
        ("/v1/completions", {"model": "gpt2", "prompt": [ids]}, 413, body),
        (
            "/v1/chat/completions",
            {"model": "gpt2", "messages": [{"role": "user", "content": text}]},
            413,
            body,
        ),
        (
            "/v1/chat/completions",
            {"model": "gpt2", "messages": [{"role": "user", "content": ""}] * 500_000},
            413,
            body,
        ),
        ("/v2/models/gpt2/generate", {"text_input": text}, 413, body),
        ("/v2/models/gpt2/generate_stream", {"text_input": text}, 413, body),
        ("/v1/completions", {"model": "gpt2", "prompt": over}, 413, "prompt: at least 4200"),
        ("/v1/completions", {"model": "gpt2", "prompt": [7] * 5000}, 400, "max_model_len"),
        (
            "/v1/chat/completions",
            {"model": "gpt2", "messages": [{"role": "user", "content": ""}] * 300},
            413,
            "messages: 300 message(s)",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "gpt2",
                "stream": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 300}],
            },
            413,
            "messages: 1 message(s)",
        ),
        ("/v2/models/gpt2/generate", {"text_input": over}, 413, "prompt: at least 4200"),
        ("/v2/models/gpt2/infer", {"inputs": [tensor]}, 413, "max_prompt_bytes"),
    ]


async def _big_grpc(target: str) -> None:
    many = apb.GenerateRequest(model_name="gpt2")
    many.messages.extend([apb.ChatMessage(role="user")] * 1_000_000)  # ~8 MB
    text = "word " * (BIG // 5)
    options = [("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        generate = apb_grpc.GenerationStub(channel)
        for request, code in [
            (apb.GenerateRequest(model_name="gpt2", prompt=text), grpc.StatusCode.RESOURCE_EXHAUSTED),
            (
                apb.GenerateRequest(model_name="gpt2", prompt_token_ids=range(BIG_IDS)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (many, grpc.StatusCode.INVALID_ARGUMENT),  # counted before copied
            (
                apb.GenerateRequest(model_name="gpt2", messages=[apb.ChatMessage(role="user", content=text)]),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ),
        ]:  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in generate.Generate(request):
                    pass
            assert exc.value.code() == code, exc.value
            assert "max_" in (exc.value.details() or "")
        infer = pb_grpc.GRPCInferenceServiceStub(channel)
        req = pb.ModelInferRequest(model_name="gpt2")
        tensor = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(text.encode())
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await infer.ModelInfer(req)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        assert "max_prompt_bytes" in (exc.value.details() or "")


async def test_huge_prompts_are_refused_by_size_without_stalling_or_keeping_memory(
    srv: ServerProcess,
) -> None:
    import psutil

    server = psutil.Process(srv.proc.pid)
    cases = _big_http()
    bodies = [(path, orjson.dumps(doc), status, text) for path, doc, status, text in cases]
    del cases
    async with aiohttp.ClientSession() as session:
        victim = "victim number 0 says"
        alone = await _victim(session, srv.base, victim)
        start_rss = server.memory_info().rss
        async with watch_loop(srv.base):
            for _ in range(2):
                beside = asyncio.create_task(_victim(session, srv.base, victim))
                for path, body, status, text in bodies:
                    async with session.post(
                        srv.base + path, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        answer = await r.text()
                        assert r.status == status, f"{path}: {r.status} {answer[:300]}"
                        assert text in answer, f"{path}: {answer[:300]}"
                await _big_grpc(srv.grpc_url)
                assert await beside == alone
        end_rss = server.memory_info().rss
    assert end_rss - start_rss < RSS_SLACK, (
        f"the server kept {(end_rss - start_rss) / 2**20:.0f} MiB "
        f"({start_rss / 2**20:.0f} -> {end_rss / 2**20:.0f} MiB)"
    )
    print(f"\nserver RSS {start_rss / 2**20:.0f} -> {end_rss / 2**20:.0f} MiB")


# --- overload: more streams than slots plus queue, clients that retry at once ------------


def _sse_text(raw: str) -> str:
    """The text of an OpenAI completion stream; it must end with [DONE] and hold no error."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    docs = [orjson.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert all("error" not in d for d in docs), raw[-300:]
    return "".join(d["choices"][0]["text"] for d in docs)


STORM_CLIENTS = 12
STORM_ROUNDS = 20


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """gpt2 with 2 KV-cache slots and 2 places in its queue."""
    server = start_gpt2_server(tmp_path_factory, "gen-overload", max_num_seqs=2, max_queue_size=2)
    yield server
    server.stop()


async def test_overflow_streams_get_429_at_once_and_admitted_streams_complete(
    small: ServerProcess,
) -> None:
    """2 slots and 2 places in the queue, taken by a burst of 4 streams while
    the step process is stopped: clients that resend the moment they are
    answered all get 429 with Retry-After, and the loop stays live. Then the
    step process goes on while the storm does; each admitted stream completes
    with its whole text."""
    base = small.base
    body = {"model": "gpt2", "prompt": "storm", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with aiohttp.ClientSession() as session:

        async def stream() -> tuple[int, str, dict[str, str]]:
            async with session.post(base + "/v1/completions", json=body) as r:
                return r.status, await r.text(), dict(r.headers)

        def gen(s: dict[str, Any]) -> tuple[int, int]:
            return s["generation"]["running_sequence_count"], s["generation"][
                "waiting_sequence_count"
            ]

        first = await stream()
        assert first[0] == 200
        want = _sse_text(first[1])
        # The step process is stopped, so that the slots stay taken while the
        # storm runs (its step in flight does not come back until SIGCONT).
        (child,) = small.spawned_children()
        child.suspend()
        try:
            # A burst that the slots and the queue can take is taken at once.
            held = await asyncio.gather(
                *(session.post(base + "/v1/completions", json=body) for _ in range(4))
            )
            # (1 running and 3 waiting when the first came alone, as the step
            # in flight admits no more: still 4 taken, the slot's place kept.)
            await wait_gen(session, base, "gpt2", lambda s: sum(gen(s)) == 4)
        except BaseException:
            child.resume()
            raise
        assert [r.status for r in held] == [200] * 4
        reading, refused = asyncio.Event(), asyncio.Event()
        answers: list[tuple[int, str, dict[str, str]]] = []
        stormed: list[None] = []

        async def reconnecting() -> None:  # sends again the moment it is answered
            for _ in range(STORM_ROUNDS):
                answers.append(await stream())
                assert answers[-1][0] == 429, answers[-1][:2]  # the queue is full
            stormed.append(None)
            if len(stormed) == STORM_CLIENTS:
                refused.set()
            while not reading.is_set():
                answers.append(await stream())

        async with watch_loop(base):
            storm = [asyncio.create_task(reconnecting()) for _ in range(STORM_CLIENTS)]
            await refused.wait()
            child.resume()
            results = [_sse_text(await r.text()) for r in held]
            reading.set()
            await asyncio.gather(*storm)
    assert results == [want] * 4  # the admitted streams are untouched
    for status, text, headers in answers:
        # Overflow is refused at once with Retry-After; one that found room (as
        # an admitted stream ended) was served in full. Nothing else.
        assert status in (200, 429), (status, text[:300])
        if status == 429:
            assert headers.get("Retry-After") == "1" and "max_queue_size" in text
        else:
            assert _sse_text(text) == want


async def test_a_full_queue_refuses_before_the_prompt_is_tokenized(small: ServerProcess) -> None:
    """With every slot and place in the queue taken, a request (OpenAI
    completions and chat, Triton generate) is refused 429 before its prompt is
    rendered and tokenized (under a retry storm that work,
    per refusal, is loop time taken from the running streams). The witness: a
    prompt longer than max_model_len in tokens, which tokenizing would refuse
    with 400, gets the 429; once there is room it gets its 400."""
    base = small.base
    held_body = {"model": "gpt2", "prompt": "storm", "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True, "stream": True}  # fmt: skip
    long_text = "a " * 200  # 400 bytes (under max_prompt_bytes), over 128 tokens
    probes = [
        ("/v1/completions", {"model": "gpt2", "prompt": long_text, "max_tokens": 4}),
        (
            "/v1/chat/completions",
            {"model": "gpt2", "messages": [{"role": "user", "content": long_text}],
             "max_tokens": 4, "stream": True},
        ),
        ("/v2/models/gpt2/generate", {"text_input": long_text, "max_tokens": 4}),
    ]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        await wait_gen(session, base, "gpt2", idle)
        (child,) = small.spawned_children()
        child.suspend()  # the first step stays in flight: slots and queue stay taken
        try:
            held = await asyncio.gather(
                *(session.post(base + "/v1/completions", json=held_body) for _ in range(4))
            )
            await wait_gen(
                session, base, "gpt2",
                lambda s: s["generation"]["running_sequence_count"]
                + s["generation"]["waiting_sequence_count"] == 4,
            )  # fmt: skip
            async with watch_loop(base):
                full = []
                for path, body in probes:
                    async with session.post(base + path, json=body) as r:
                        full.append((r.status, await r.text(), r.headers.get("Retry-After")))
        finally:
            child.resume()
        for r in held:
            assert r.status == 200
            await r.read()
        await wait_gen(session, base, "gpt2", idle)
        room = []
        for path, body in probes:
            async with session.post(base + path, json=body) as r:
                room.append((r.status, await r.text()))
    for status, text, retry_after in full:
        assert (status, retry_after) == (429, "1"), (status, text[:300])
        assert "max_queue_size" in text, text[:300]
    for status, text in room:
        assert status == 400 and "max_model_len" in text, (status, text[:300])


# --- many empty chat messages: counted, and rendered off the loop ------------------------

MANY_CLIENTS = 8
MANY_ROUNDS = 3


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """gpt2 with the prompt byte limit of a 2048-token model (64 KiB): a chat of
    thousands of empty messages is under it."""
    server = start_gpt2_server(tmp_path_factory, "gen-many-messages", max_prompt_bytes=65536)
    yield server
    server.stop()


async def test_many_empty_messages_are_refused_by_count_or_rendered_off_the_loop(
    wide: ServerProcess,
) -> None:
    """2,040 empty messages (a 67 KB body, 0 characters of text) are over
    generation.max_chat_messages: 400 naming it. 1,000 are under it, and are
    16 KB by the structure counted, so they are rendered and tokenized off the
    loop (their prompt is then too long for the model: 400 naming
    max_model_len). Eight clients send them back to back while a victim
    streams; the loop stays live and the victim's text is what it is alone."""
    over = orjson.dumps({"model": "gpt2", "messages": [{"role": "user", "content": ""}] * 2040})
    under = orjson.dumps({"model": "gpt2", "messages": [{"role": "user", "content": ""}] * 1000})
    headers = {"Content-Type": "application/json"}
    url = wide.base + "/v1/chat/completions"
    answers: list[tuple[int, str]] = []
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for _ in range(MANY_ROUNDS):
                for body in (over, under):
                    async with session.post(url, data=body, headers=headers) as r:
                        answers.append((r.status, await r.text()))

        victim = "victim number 0 says"
        alone = await _victim(session, wide.base, victim)
        async with watch_loop(wide.base):
            results = await asyncio.gather(
                _victim(session, wide.base, victim), *(client() for _ in range(MANY_CLIENTS))
            )
        assert results[0] == alone
    assert len(answers) == 2 * MANY_CLIENTS * MANY_ROUNDS
    refused = [text for status, text in answers if "max_chat_messages" in text]
    rendered = [text for status, text in answers if "max_model_len" in text]
    assert all(status == 400 for status, _ in answers), answers[:2]
    assert len(refused) == len(rendered) == MANY_CLIENTS * MANY_ROUNDS, answers[:2]
    assert "messages: 2040 messages, over the limit generation.max_chat_messages 1024" in refused[0]
    assert orjson.loads(refused[0])["error"]["param"] == "messages"
