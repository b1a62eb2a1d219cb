"""Fuzzing the generation routes while greedy streams run beside the fuzzer.

hypothesis builds malformed requests for the OpenAI API (completions and
chat), Triton's generate extension and gRPC ``Generate``: each starts from a
valid request and breaks one thing in a way certain to be wrong (a sampling
setting past its bound, NaN and infinities, a wrong type, a prompt over its
limits or with ids outside the vocabulary, several prompts or none, an
unknown model). Every one must be answered with a 4xx (gRPC
``INVALID_ARGUMENT`` / ``NOT_FOUND`` / ``RESOURCE_EXHAUSTED``) and a message.

Meanwhile greedy streams (OpenAI SSE, OpenAI NDJSON and gRPC) run in a loop on the same
engine; each must end with exactly the text it gives alone, and the event
loop's liveness is polled throughout (``stall_watch``). Runs are
reproducible (``derandomize=True``, no example database).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from conftest import ServerProcess
from gen_helpers import GENERATION, start_gpt2_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stall_watch import LoopWatch, watch_loop

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc

pytestmark = pytest.mark.timeout(240)

CAP = GENERATION["max_tokens_cap"]  # 120
MAX_MODEL_LEN = GENERATION["max_model_len"]  # 128
PROMPT_LIMIT = 32 * MAX_MODEL_LEN  # generation.max_prompt_bytes by default
INT32_MAX = 2**31 - 1
CALL_TIMEOUT_S = 20
EXAMPLES = {"openai": 200, "generate": 150, "grpc": 200}
GRPC_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_gpt2_server(tmp_path_factory, "gen-fuzz")
    yield server
    server.stop()


# --- values certain to be wrong -------------------------------------------------------

NON_INT = st.one_of(  # None means "absent", so it is not among them
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
)
NON_NUMBER = st.one_of(st.booleans(), st.text(max_size=6), st.lists(st.integers(), max_size=2))
NOT_TEXT = st.one_of(st.booleans(), st.integers(), st.lists(st.text(max_size=3), max_size=2))
HUGE_INT = st.integers(2**31, 2**64 - 1)
BAD: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(NON_INT, st.integers(max_value=0), st.integers(CAP + 1, 2**64 - 1)),
    "temperature": st.one_of(
        NON_NUMBER,
        st.floats(max_value=-1e-9, allow_infinity=False, allow_nan=False),
        st.floats(min_value=2.0000001, allow_infinity=False, allow_nan=False),
        st.integers(3, 2**64),
    ),
    "top_p": st.one_of(
        NON_NUMBER,
        st.floats(max_value=0, allow_infinity=False, allow_nan=False),
        st.floats(min_value=1.0000001, allow_infinity=False, allow_nan=False),
    ),
    "top_k": st.one_of(NON_INT, st.integers(max_value=-2), HUGE_INT),
    "seed": st.one_of(NON_INT, st.integers(2**64, 2**64 + 10**6)),
    "stop": st.one_of(
        st.integers(),
        st.just(""),
        st.just(["a", ""]),
        st.lists(st.integers(), min_size=1, max_size=3),
        st.integers(257, 2000).map(lambda n: ["x" * n]),
        st.lists(st.just("s"), min_size=17, max_size=20),
    ),
    "ignore_eos": st.one_of(st.integers(), st.text(max_size=4)),
}
PROMPT_BAD: st.SearchStrategy[Any] = st.one_of(
    st.integers(PROMPT_LIMIT + 1, 4 * PROMPT_LIMIT).map(lambda n: "a" * n),
    st.integers(PROMPT_LIMIT // 2 + 1, PROMPT_LIMIT).map(lambda n: "é" * n),  # 2 bytes each
    st.lists(st.integers(10**6, 2**63), min_size=1, max_size=4),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
    st.integers(MAX_MODEL_LEN, 4 * MAX_MODEL_LEN).map(lambda n: [7] * n),
    st.integers(1, 3).map(lambda n: [[7, "x"]] * n),
)


# --- requests ---------------------------------------------------------------------------


@dataclass
class Http:
    path: str
    doc: Any
    accept: str | None = None  # NDJSON or SSE: refusals come before either starts

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return f"Http({self.path} accept={self.accept!r} {repr(self.doc)[:600]})"


ACCEPT = st.sampled_from([
    None, "application/x-ndjson", "text/event-stream", "application/x-ndjson;q=0.5, */*",
    "text/event-stream;q=0.1, application/x-ndjson", "application/x-ndjson;q=junk",
])  # fmt: skip


@dataclass
class Grpc:
    request: apb.GenerateRequest = field(default_factory=apb.GenerateRequest)

    def __repr__(self) -> str:
        return f"Grpc({str(self.request)[:600]!r})"


@st.composite
def openai_malformed(draw: st.DrawFn) -> Http:
    chat = draw(st.booleans())
    doc: dict[str, Any] = {"model": "gpt2", "max_tokens": 4, "stream": draw(st.booleans())}
    if chat:
        doc["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        doc["prompt"] = "Hi"
    kind = draw(st.sampled_from([*sorted(BAD), "prompt", "model"]))
    if kind == "prompt":
        value = draw(PROMPT_BAD)
        if chat:
            if not isinstance(value, str):
                value = "a" * (PROMPT_LIMIT + 1)
            doc["messages"] = [{"role": "user", "content": value}]
        else:
            doc["prompt"] = value
    elif kind == "model":
        doc["model"] = draw(st.text(min_size=1, max_size=8).filter(lambda m: m != "gpt2"))
    else:
        doc[kind] = draw(BAD[kind])
    return Http("/v1/chat/completions" if chat else "/v1/completions", doc, draw(ACCEPT))


@st.composite
def generate_malformed(draw: st.DrawFn) -> Http:
    path = "/v2/models/gpt2/" + draw(st.sampled_from(["generate", "generate_stream"]))
    doc: dict[str, Any] = {"text_input": "Hi", "parameters": {"max_tokens": 4}}
    kind = draw(st.sampled_from([*sorted(BAD), "text_input"]))
    if kind == "text_input":
        value = draw(PROMPT_BAD)
        doc["text_input"] = value if isinstance(value, str) else draw(NOT_TEXT)
    elif draw(st.booleans()):
        doc["parameters"][kind] = draw(BAD[kind])
    else:  # Triton reads top-level keys as parameters (the "parameters" object wins)
        doc = {"text_input": "Hi", "max_tokens": 4, kind: draw(BAD[kind])}
    return Http(path, doc, draw(ACCEPT))


GRPC_BAD: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.just(0), st.integers(CAP + 1, 2**32 - 1)),
    "temperature": st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.floats(max_value=-1e-9, allow_infinity=False, allow_nan=False),
        st.floats(min_value=2.0000001, allow_nan=False),
    ),
    "top_p": st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
        st.floats(max_value=0, allow_nan=False),
        st.floats(min_value=1.0000001, allow_nan=False),
    ),
    "top_k": st.integers(2**31, 2**32 - 1),
    "stop": st.one_of(
        st.just([""]),
        st.integers(257, 2000).map(lambda n: ["x" * n]),
        st.lists(st.just("s"), min_size=17, max_size=20),
    ),
}


@st.composite
def grpc_malformed(draw: st.DrawFn) -> Grpc:
    req = apb.GenerateRequest(model_name="gpt2", prompt="Hi")
    req.sampling.max_tokens = 4
    kind = draw(st.sampled_from([*sorted(GRPC_BAD), "prompt", "ids", "none", "two", "model"]))
    if kind in GRPC_BAD:
        value = draw(GRPC_BAD[kind])
        if kind == "stop":
            req.sampling.stop.extend(value)
        else:
            setattr(req.sampling, kind, value)
    elif kind == "prompt":
        req.prompt = "a" * draw(st.integers(PROMPT_LIMIT + 1, 4 * PROMPT_LIMIT))
    elif kind == "ids":
        req.ClearField("prompt")
        req.prompt_token_ids.extend(
            draw(
                st.one_of(
                    st.lists(st.integers(10**6, 2**32 - 1), min_size=1, max_size=4),
                    st.integers(MAX_MODEL_LEN, 4 * MAX_MODEL_LEN).map(lambda n: [7] * n),
                )
            )
        )
    elif kind == "none":
        req.ClearField("prompt")
    elif kind == "two":
        req.prompt_token_ids.append(7)
        if draw(st.booleans()):
            req.messages.add(role="user", content="Hi")
    else:
        req.model_name = draw(st.text(min_size=1, max_size=8).filter(lambda m: m != "gpt2"))
    return Grpc(req)


# --- the loop in a thread: clients, victims, watchdog ---------------------------------------

VICTIM_TOKENS = 12


class Bench:
    """A loop in a thread that owns the clients, runs the greedy victims and the
    watchdog, and sends the fuzzer's requests one at a time."""

    def __init__(self, base: str, grpc_target: str) -> None:
        self.base, self.grpc_target = base, grpc_target
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sent = 0
        self.victims: list[str] = []
        self.victim_errors: list[str] = []
        self.watch: LoopWatch | None = None
        self._stop: asyncio.Event | None = None
        self._background: Any = None
        self.call(self._open())

    def call(self, coro: Any, timeout: float = CALL_TIMEOUT_S + 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        self.channel = grpc.aio.insecure_channel(self.grpc_target)
        self.stub = apb_grpc.GenerationStub(self.channel)
        self._stop = asyncio.Event()

    # victims

    async def openai_victim(self) -> str:
        body = {"model": "gpt2", "prompt": "victim says", "max_tokens": VICTIM_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        pieces = []
        async with self.session.post(self.base + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise AssertionError(f"victim got {r.status}: {await r.text()}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    doc = orjson.loads(line[6:])
                    if "error" in doc:
                        raise AssertionError(f"victim failed: {doc}")
                    pieces.append(doc["choices"][0]["text"])
        return "".join(pieces)

    async def ndjson_victim(self) -> str:
        """The OpenAI victim's request, streamed as newline-delimited JSON."""
        body = {"model": "gpt2", "prompt": "victim says", "max_tokens": VICTIM_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        pieces = []
        headers = {"Accept": "application/x-ndjson"}
        async with self.session.post(
            self.base + "/v1/completions", json=body, headers=headers
        ) as r:
            if r.status != 200 or r.content_type != "application/x-ndjson":
                raise AssertionError(f"victim got {r.status} {r.content_type}: {await r.text()}")
            async for line in r.content:
                doc = orjson.loads(line)
                if "error" in doc:
                    raise AssertionError(f"victim failed: {doc}")
                pieces.append(doc["choices"][0]["text"])
        return "".join(pieces)

    async def grpc_victim(self) -> str:
        req = apb.GenerateRequest(model_name="gpt2", prompt="victim says")
        req.sampling.max_tokens, req.sampling.temperature = VICTIM_TOKENS, 0.0
        req.sampling.ignore_eos = True
        return "".join([m.text async for m in self.stub.Generate(req, timeout=CALL_TIMEOUT_S)])

    async def _victims(self, want: tuple[str, str, str]) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            for i, got in enumerate(
                await asyncio.gather(
                    self.openai_victim(),
                    self.grpc_victim(),
                    self.ndjson_victim(),
                    return_exceptions=True,
                )
            ):
                if got != want[i]:
                    self.victim_errors.append(repr(got)[:300])
                self.victims.append(str(i))

    async def _watched(self, want: tuple[str, str, str], started: asyncio.Event) -> None:
        async with watch_loop(self.base) as watch:
            self.watch = watch
            victims = asyncio.create_task(self._victims(want))
            started.set()
            assert self._stop is not None
            await self._stop.wait()
            await victims

    def start_background(self, want: tuple[str, str, str]) -> None:
        async def begin() -> None:
            started = asyncio.Event()
            self._background = asyncio.create_task(self._watched(want, started))
            await started.wait()

        self.call(begin(), timeout=60)

    def stop_background(self) -> None:
        async def end() -> None:
            assert self._stop is not None
            self._stop.set()
            await self._background

        self.call(end(), timeout=60)

    # the fuzzer's requests

    async def _http(self, req: Http) -> tuple[int, bytes]:
        body = json.dumps(req.doc).encode()  # the stdlib writes integers of any size
        headers = {"Content-Type": "application/json"}
        if req.accept is not None:
            headers["Accept"] = req.accept
        async with self.session.post(self.base + req.path, data=body, headers=headers) as r:
            return r.status, await r.read()

    async def _grpc(self, req: Grpc) -> tuple[grpc.StatusCode, str]:
        try:
            async for _ in self.stub.Generate(req.request, timeout=CALL_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    def refused(self, req: Http | Grpc) -> None:
        self.sent += 1
        if isinstance(req, Http):
            status, body = self.call(self._http(req))
            assert 400 <= status < 500, f"{status} for {req!r}: {body[:400]!r}"
            doc = orjson.loads(body)
            error = doc.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            assert isinstance(message, str) and message, f"no message in {doc!r} for {req!r}"
        else:
            code, details = self.call(self._grpc(req))
            assert code in GRPC_REFUSALS, f"{code} {details!r} for {req!r}"
            assert details, f"no message for {req!r}"

    def close(self) -> None:
        async def shut() -> None:
            await self.session.close()
            await self.channel.close()

        self.call(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _fuzz(examples: int) -> Any:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def test_malformed_generation_requests_get_4xx_and_never_fail_a_stream(
    srv: ServerProcess,
) -> None:
    bench = Bench(srv.base, srv.grpc_url)
    try:
        want = (
            bench.call(bench.openai_victim()),
            bench.call(bench.grpc_victim()),
            bench.call(bench.ndjson_victim()),
        )
        assert want[0] == want[1] == want[2] and want[0]
        bench.start_background(want)
        for name, strategy in [
            ("openai", openai_malformed()),
            ("generate", generate_malformed()),
            ("grpc", grpc_malformed()),
        ]:

            @_fuzz(EXAMPLES[name])
            @given(strategy)
            def check(req: Http | Grpc) -> None:
                bench.refused(req)

            check()
        bench.stop_background()
        assert bench.victim_errors == [], bench.victim_errors[:5]
        assert len(bench.victims) >= 4, "the victims did not run beside the fuzzer"
        assert bench.watch is not None
        bench.watch.check()
    finally:
        bench.close()
    assert bench.sent >= sum(EXAMPLES.values()) // 2
    log = srv.log_text()
    assert "Traceback" not in log, log[-3000:]
    print(f"\n{bench.sent} malformed generation requests; {len(bench.victims)} victim streams")
