"""A decoder model's steps in a child process: same tokens as on a thread, and
a child that dies is replaced while the server goes on serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess, start_server, write_config
from gen_helpers import GENERATION, gen_stats, idle, wait_gen
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(90)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def two_ways(
    decoder_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """gpt2 served twice: steps in a child process (the default) and on a thread."""
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    models = [
        {**gpt2, "name": "proc", "generation": {**GENERATION, "step_run_ahead": 4}},
        {**gpt2, "name": "thread", "generation": {**GENERATION, "step_process": False}},
    ]
    folder = tmp_path_factory.mktemp("step-process")
    srv = start_server(write_config(folder, {"grpc": {"port": 0}, "models": models}))
    yield srv
    srv.stop()


async def health_changes(target: str, service: str, watching: asyncio.Event) -> list[int]:
    """Statuses a Health.Watch of ``service`` reports, until it is back to SERVING;
    ``watching`` is set once the watch has its first answer."""
    seen: list[int] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        async for answer in stub.Watch(health_pb2.HealthCheckRequest(service=service)):
            seen.append(answer.status)
            watching.set()
            if answer.status == SERVING and NOT_SERVING in seen:
                return seen
    return seen


async def complete(session: aiohttp.ClientSession, base: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def test_process_and_thread_give_the_same_tokens(two_ways: ServerProcess) -> None:
    assert len(two_ways.spawned_children()) == 1  # only "proc" has a child
    prompts = ["Hello", "The quick brown fox", "server streams tokens"]
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            assert await complete(session, two_ways.base, "proc", prompt) == await complete(
                session, two_ways.base, "thread", prompt
            )


async def test_killed_step_process_fails_its_streams_and_comes_back(
    two_ways: ServerProcess,
) -> None:
    base = two_ways.base
    async with aiohttp.ClientSession() as session:
        want = await complete(session, base, "proc", "Hello")
        (child,) = two_ways.spawned_children()
        watching = asyncio.Event()
        watch = asyncio.create_task(health_changes(two_ways.grpc_url, "proc", watching))
        await asyncio.wait_for(watching.wait(), 30)  # its first answer: SERVING
        body = {"model": "proc", "prompt": "Hi", "max_tokens": 120, "stream": True}
        body["ignore_eos"] = True
        before = (await gen_stats(session, base, "proc"))["generation"]
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            for _ in range(3):  # the stream is running, and tokens 2 and 3 came
                await r.content.readuntil(b"\n\n")  # from steps the child ran ahead
            os.kill(child.pid, signal.SIGKILL)
            events = (await asyncio.wait_for(r.content.read(), 20)).split(b"\n\n")
        # The stream ends with an error event naming what happened, not a hang.
        docs = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        assert "step process" in docs[-1]["error"]["message"]
        running_ahead = (await gen_stats(session, base, "proc"))["generation"]
        assert running_ahead["ahead_step_count"] >= before["ahead_step_count"] + 2
        # A new child is started; until then the model is not ready.
        deadline = time.monotonic() + 30
        while True:
            async with session.get(base + "/v2/models/proc/ready") as ready:
                if ready.status == 200:
                    break
            assert time.monotonic() < deadline, "the step process did not come back"
            await asyncio.sleep(0.1)
        # gRPC health watchers heard it go down and come back.
        assert await asyncio.wait_for(watch, 30) == [SERVING, NOT_SERVING, SERVING]
        (new_child,) = two_ways.spawned_children()
        assert new_child.pid != child.pid
        assert await complete(session, base, "proc", "Hello") == want
        after = await wait_gen(session, base, "proc", idle)
        assert after["generation"]["kv_slots_in_use"] == 0
        # The other model never noticed.
        assert (await gen_stats(session, base, "thread"))["generation"][
            "running_sequence_count"
        ] == 0


def test_weights_that_fail_in_the_child_fail_the_start_with_the_reason(
    decoder_models: dict[str, Any], tmp_path: Path
) -> None:
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(gpt2["path"]).iterdir():
        data = _overlapping(f.read_bytes()) if f.suffix == ".safetensors" else f.read_bytes()
        (broken / f.name).write_bytes(data)
    config = write_config(tmp_path, {"models": [{**gpt2, "path": str(broken)}]})
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "model 'gpt2/1' failed to load" in done.stderr
    assert "safetensorerror" in done.stderr.lower()  # the child's own reason


def _overlapping(data: bytes) -> bytes:
    """A safetensors file whose header the server's checks pass (every tensor
    there, its shape, its bytes within the file) but whose tensors all start at
    byte 0: safetensors refuses it when the child loads it."""
    length = int.from_bytes(data[:8], "little")
    header = orjson.loads(data[8 : 8 + length])
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = [0, end - begin]
    raw = orjson.dumps(header)
    return len(raw).to_bytes(8, "little") + raw + data[8 + length :]


@pytest.fixture
def two_slots(decoder_models: dict[str, Any], tmp_path: Path) -> Iterator[ServerProcess]:
    """gpt2 with its steps in a child process and 2 KV-cache slots."""
    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    generation = {**GENERATION, "max_num_seqs": 2, "stream_buffer_chunks": 1}
    srv = start_server(write_config(tmp_path, {"models": [{**gpt2, "generation": generation}]}))
    yield srv
    srv.stop()


async def test_killed_step_process_keeps_the_waiting_sequences_queued(
    two_slots: ServerProcess,
) -> None:
    """Only the sequences the child held fail; those waiting for a slot, and
    those arriving while the new child starts, are served by the new child."""
    base = two_slots.base
    prompts = [f"waiting number {i}" for i in range(4)]
    async with aiohttp.ClientSession() as session:
        want = {p: await complete(session, base, "gpt2", p) for p in [*prompts, "late one"]}
        body = {"model": "gpt2", "prompt": "Hi", "max_tokens": 120, "stream": True}
        body["ignore_eos"] = True
        streams = [await session.post(base + "/v1/completions", json=body) for _ in range(2)]
        for r in streams:  # both hold a slot; unread, they sit paused in it
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
        waiting = [asyncio.create_task(complete(session, base, "gpt2", p)) for p in prompts]
        await wait_gen(
            session, base, "gpt2", lambda s: s["generation"]["waiting_sequence_count"] == 4
        )
        (child,) = two_slots.spawned_children()
        os.kill(child.pid, signal.SIGKILL)
        for r in streams:  # the running ones fail, naming what happened
            events = (await asyncio.wait_for(r.content.read(), 20)).split(b"\n\n")
            docs = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]
            assert "step process" in docs[-1]["error"]["message"]
            r.close()
        # A request that arrives while the new child starts waits for it too.
        deadline = time.monotonic() + 30
        while True:
            async with session.get(base + "/v2/models/gpt2/ready") as ready:
                if ready.status != 200:
                    break
            assert not all(t.done() for t in waiting), "the child came back unseen"
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        late = asyncio.create_task(complete(session, base, "gpt2", "late one"))
        got = await asyncio.wait_for(asyncio.gather(*waiting, late), 60)
        assert got == [want[p] for p in [*prompts, "late one"]]
        assert len(two_slots.spawned_children()) == 1
        after = await wait_gen(session, base, "gpt2", idle)
        assert after["generation"]["kv_slots_in_use"] == 0


def test_a_sequence_that_cannot_cross_the_pipe_is_refused_before_it_is_queued(
    decoder_models: dict[str, Any],
) -> None:
    from aserve.engines.decoder import DecoderEngine
    from aserve.errors import InvalidArgument
    from aserve.types.generation import SamplingParams
    from aserve.workers.step_process import ProcessStepExecutor, WorkerArgs

    gpt2 = next(m for m in decoder_models["models"] if m["name"] == "gpt2")
    engine = DecoderEngine(gpt2["path"])
    engine.load_front()
    executor = ProcessStepExecutor(
        WorkerArgs(gpt2["path"], {}, "cpu", "float32", 1, "gpt2"), on_lost=lambda _: None
    )
    executor.check(engine.new_sequence("fine", "Hello", SamplingParams()))
    bad = engine.new_sequence("\ud800", "Hello", SamplingParams())  # not UTF-8: msgpack refuses
    with pytest.raises(InvalidArgument, match="cannot be sent to the step process"):
        executor.check(bad)
