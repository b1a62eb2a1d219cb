"""The one deadline rule, route by route: the earliest of the request's header,
body parameter and gRPC call deadline applies, whichever carries it.

Each route gets a request whose header asks for 100 ms and whose body asks for
60 s, and one the other way round, while its model cannot answer (its worker
or step process is held stopped): the 100 ms must end both. Generation
controls that ask for 60 s both ways complete, so a timeout is the rule's doing.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from gen_helpers import GENERATION
from helpers import frozen, v2_body, wait_for_stats, wait_idle
from lm_models import tiny_model
from stall_watch import watch_loop

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

HANDLERS = Path(__file__).parent / "handlers"
SHORT_MS, LONG_MS = 100, 60_000
HEADER = "aserve-timeout-ms"
ANSWERED_WITHIN_S = 30  # a loose watchdog: the 60 s deadline would still be waiting


@pytest.fixture(scope="module")
def srv(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("deadline-routes")
    shutil.copy(HANDLERS / "raw_body.py", folder / "raw_body.py")
    gpt2 = tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    config = {
        "grpc": {"port": 0},
        "models": [
            model_entry(
                "spin", str(model_dir / "spin.pt"), [spec("X", "FP32", [-1])],
                [spec("Y", "FP32", [1])], batching={"max_batch_size": 4, "max_delay_ms": 0},
                executor="process",
            ),
            {
                "name": "raw", "engine": "python", "handler": "raw_body:RawBody",
                "executor": "process",
                "inputs": [spec("TEXT", "BYTES", [1])],
                "outputs": [spec("LENGTH", "INT64", [1]), spec("BATCH", "INT64", [1])],
                "batching": {"max_batch_size": 8, "max_delay_ms": 0, "timeout_ms": LONG_MS},
            },
            {
                "name": "gpt2", "engine": "decoder", "path": str(gpt2),
                "generation": {**GENERATION, "max_num_seqs": 16, "max_queue_size": 32,
                               "timeout_ms": LONG_MS},
            },
        ],
    }  # fmt: skip
    server = start_server(write_config(folder, config))
    yield server
    server.stop()


async def _post(
    session: aiohttp.ClientSession, url: str, body: Any, header_ms: int | None = None
) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if header_ms is not None:
        headers[HEADER] = str(header_ms)
    async with session.post(url, data=orjson.dumps(body), headers=headers) as r:
        return r.status, await r.text()


def _timed_out(status: int, text: str) -> bool:
    """Ended by its deadline: in the queue (504), or refused at once by admission
    for the little time it had (503), never later than 100 ms asked for."""
    if status == 504 and "timed out" in text:
        return True
    return status == 503 and "cannot meet the request's deadline" in text


@pytest.mark.parametrize(
    ("route", "model"), [("/v2/models/spin/infer", "spin"), ("/predictions/raw", "raw")]
)
async def test_batched_routes_take_the_earlier_of_header_and_body(
    srv: ServerProcess, route: str, model: str
) -> None:
    base = srv.base
    if model == "spin":

        def body(ms: int) -> Any:
            return v2_body("X", [1.0], [1, 1], parameters={"timeout_ms": ms})

        holder = body(LONG_MS)
        # header 100 ms + body 60 s, and body 100 ms + header 60 s
        asks = [(body(LONG_MS), SHORT_MS), (body(SHORT_MS), LONG_MS)]
    else:  # a raw body has no parameters: the header against the model's 60 s default
        holder = {"hold": True}
        asks = [({"a": 1}, SHORT_MS)]
    async with aiohttp.ClientSession() as session, watch_loop(base):
        await wait_idle(session, base, model)
        with frozen(srv.worker_pid(model)):
            held = asyncio.create_task(_post(session, base + route, holder, LONG_MS))
            await wait_for_stats(session, base, model, lambda s: s["running_batch_count"] == 1)
            answers = await asyncio.wait_for(
                asyncio.gather(*(_post(session, base + route, b, h) for b, h in asks)),
                ANSWERED_WITHIN_S,
            )
        assert (await held)[0] == 200
    for (status, text), ask in zip(answers, asks, strict=True):
        assert _timed_out(status, text), (route, ask[1], status, text)


async def test_grpc_model_infer_takes_the_parameter_when_earlier_than_the_call(
    srv: ServerProcess,
) -> None:
    request = pb.ModelInferRequest(model_name="spin", id="short")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    tensor.contents.fp32_contents.append(1.0)
    request.parameters["timeout_ms"].int64_param = SHORT_MS
    async with aiohttp.ClientSession() as session, watch_loop(srv.base):
        await wait_idle(session, srv.base, "spin")
        with frozen(srv.worker_pid("spin")):
            body = v2_body("X", [1.0], [1, 1], parameters={"timeout_ms": LONG_MS})
            held = asyncio.create_task(_post(session, srv.base + "/v2/models/spin/infer", body))
            await wait_for_stats(session, srv.base, "spin", lambda s: s["running_batch_count"] == 1)
            async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.ModelInfer(request, timeout=LONG_MS / 1e3)
        assert (await held)[0] == 200
    # The server's own answer (the call had 60 s): the parameter's 100 ms applied.
    assert exc.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    details = exc.value.details() or ""
    assert "timed out" in details or "cannot meet the request's deadline" in details, details


def _generation_asks() -> list[tuple[str, str, Any, int, bool]]:
    """(name, path, body, header ms, expect timeout) for every HTTP generation route."""
    prompt = {"max_tokens": 2, "temperature": 0}

    def openai(path: str, ms: int, header: int, short: bool, **kw: Any) -> tuple[Any, ...]:
        return (path, path, {"model": "gpt2", **prompt, "timeout_ms": ms, **kw}, header, short)

    def triton(path: str, ms: int, header: int, short: bool) -> tuple[Any, ...]:
        body = {"text_input": "hi", "parameters": {**prompt, "timeout_ms": ms}}
        return (path, "/v2/models/gpt2/" + path, body, header, short)

    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    asks = []
    for ms, header, short in ((LONG_MS, SHORT_MS, True), (SHORT_MS, LONG_MS, True),
                              (LONG_MS, LONG_MS, False)):  # fmt: skip
        asks.append(openai("/v1/completions", ms, header, short, prompt="hi"))
        asks.append(openai("/v1/chat/completions", ms, header, short, **chat))
        asks.append(triton("generate", ms, header, short))
        asks.append(triton("generate_stream", ms, header, short))
    return asks


def _generation_timed_out(status: int, text: str) -> bool:
    """A generation that its deadline ended: 504 before the stream started, or
    the stream's last event saying so (after its 200)."""
    if status == 504:
        return "timed out" in text
    return status == 200 and '"error"' in text and "timed out" in text


async def test_generation_routes_take_the_earliest_of_header_body_and_call(
    srv: ServerProcess,
) -> None:
    base = srv.base
    asks = _generation_asks()
    workers = {srv.worker_pid("spin"), srv.worker_pid("raw")}
    (step,) = [p for p in srv.spawned_children() if p.pid not in workers]
    async with aiohttp.ClientSession() as session, watch_loop(base):
        status, text = await _post(session, base + "/v1/completions",
                                   {"model": "gpt2", "prompt": "hi", "max_tokens": 2})  # fmt: skip
        assert status == 200, text
        async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
            stub = apb_grpc.GenerationStub(channel)

            async def generate(field_ms: int) -> str:
                request = apb.GenerateRequest(model_name="gpt2", prompt="hi", timeout_ms=field_ms)
                request.sampling.max_tokens = 2
                try:
                    return "".join([m.text async for m in stub.Generate(request, timeout=60)])
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"

            # The step process stopped: its step in flight does not come back,
            # so every generation waits (or runs) until it goes on.
            step.suspend()
            try:
                http = [
                    asyncio.create_task(_post(session, base + path, body, header))
                    for _, path, body, header, _ in asks
                ]
                grpc_calls = [asyncio.create_task(generate(ms)) for ms in (SHORT_MS, LONG_MS)]
                total = len(http) + len(grpc_calls)
                await wait_for_stats(
                    session, base, "gpt2",
                    lambda s: s["generation"]["running_sequence_count"]
                    + s["generation"]["waiting_sequence_count"] == total,
                )  # fmt: skip
                # Time alone passes a deadline: past the short ones, far from the long ones.
                await asyncio.sleep(3 * SHORT_MS / 1e3)
            finally:
                step.resume()
            answers = await asyncio.wait_for(asyncio.gather(*http), ANSWERED_WITHIN_S)
            grpc_answers = await asyncio.wait_for(asyncio.gather(*grpc_calls), ANSWERED_WITHIN_S)
    for (name, _, body, header, short), (status, text) in zip(asks, answers, strict=True):
        where = (name, header, body.get("timeout_ms", body.get("parameters")))
        if short:
            assert _generation_timed_out(status, text), (where, status, text[-300:])
        else:
            assert status == 200 and "timed out" not in text, (where, status, text[-300:])
    short_grpc, long_grpc = grpc_answers
    assert short_grpc.startswith("DEADLINE_EXCEEDED: generation timed out"), short_grpc
    assert "DEADLINE_EXCEEDED" not in long_grpc, long_grpc


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_openai_refuses_a_bad_timeout_field_naming_it(srv: ServerProcess, path: str) -> None:
    body: dict[str, Any] = {"model": "gpt2", "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as session, watch_loop(srv.base):
        for value in (0, -1, -0.5, "inf", True, []):
            status, text = await _post(session, srv.base + path, {**body, "timeout_ms": value})
            assert status == 400, (value, text)
            error = orjson.loads(text)["error"]
            assert error["param"] == "timeout_ms" and "timeout_ms" in error["message"], error
        status, text = await _post(session, srv.base + path, {**body, "timeout_ms": None})
        assert status == 200, text  # null: not given, as OpenAI's clients send unset fields
