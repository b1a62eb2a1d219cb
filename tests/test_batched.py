"""aserve.Batched: the deadline batcher inside a user's own app (service-streamer's job).

Real web apps on loopback with real clients: the library page's Flask example
(docs/guide/library.md) under
werkzeug's threaded server and 64 client threads, a FastAPI app under uvicorn
that awaits. Batches larger than one are made certain, not likely: the
function holds its first batch until every other call is queued (a
``threading.Event`` the test sets), and worker processes are held with
SIGSTOP (``frozen``), never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
import psutil
import pytest
from batched_fns import DIE
from helpers import frozen

import aserve
from aserve.errors import Unavailable
from aserve.library import Batched, BatchFailed, NotSendable, Timeout
from aserve.library.pools import spread

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guide" / "library.md"
CLIENTS = 64


class Gate:
    """Wraps a batch function: records each batch's size, and once armed holds the
    next batch until released, so that the test decides when the function is busy."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.sizes: list[int] = []
        self.armed = False
        self.held = 0  # the size of the batch held
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch: Any) -> Any:
        self.sizes.append(len(batch))
        if self.armed:
            self.armed = False
            self.held = len(batch)
            self.entered.set()
            assert self.release.wait(60), "the test never released the batch"
        return self.fn(batch)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def hold_then_release(gate: Gate, batched: Batched[Any, Any]) -> None:
    """With the gate armed and the calls sent: wait until one batch is held and every
    other call is queued behind it, then let it go (blocking: run it off any loop)."""
    assert gate.entered.wait(30), "no batch reached the function"
    # Calls that arrive in one loop pass batch together: the held batch may hold several.
    wait_until(
        lambda: batched.stats()["pending_request_count"] == CLIENTS - gate.held,
        "every call to queue",
    )
    gate.release.set()


def expected_sizes(gate: Gate, max_batch_size: int = 32) -> list[int]:
    """The held batch, then the calls queued behind it in full batches."""
    rest = CLIENTS - gate.held
    tail = [rest % max_batch_size] if rest % max_batch_size else []
    return [gate.held] + [max_batch_size] * (rest // max_batch_size) + tail


# --- the library page's Flask app -------------------------------------------------


def readme_example() -> str:
    text = PAGE.read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]


def load_example(gate_name: str) -> ModuleType:
    """The page's example as a module, its function wrapped in a gate (the only edit)."""
    code = readme_example()
    call = "aserve.Batched(predict,"
    assert call in code, "the library page's example no longer wraps predict: update this test"
    module = ModuleType("readme_flask_app")
    module.__dict__[gate_name] = None
    code = code.replace(call, f"aserve.Batched({gate_name} := Gate(predict),")
    # While the test holds a batch, 63 client threads connect and send: on a loaded
    # machine that may take longer than the example's timeout, which is not under test.
    code, n = re.subn(r"timeout_ms=[0-9_]+", "timeout_ms=60_000", code)
    assert n == 1, "the library page's example's timeout_ms moved: update this test"
    module.__dict__["Gate"] = Gate
    exec(compile(code, str(PAGE), "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def wsgi_server(app: Any) -> Iterator[str]:
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


def post_json(url: str, body: Any) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_flask_app_from_the_readme_batches_64_threads_with_per_request_answers():
    example = load_example("gate")
    gate, batched = example.gate, example.batched
    texts = [f"text {i} " + "x" * i for i in range(CLIENTS)]
    answers: list[Any] = [None] * CLIENTS
    with batched, wsgi_server(example.app) as base:
        # A few calls first, so the latency model has run times (a held batch can then
        # move its estimate by 2x at most, and batches are cut at full size).
        for _ in range(3):
            assert post_json(f"{base}/predict", {"text": "warm"}) == {"text": "warm", "length": 4}

        def client(i: int) -> None:
            answers[i] = post_json(f"{base}/predict", {"text": texts[i]})

        gate.armed = True
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        hold_then_release(gate, batched)
        for t in threads:
            t.join(60)
        stats = batched.stats()
    assert answers == [{"text": t, "length": len(t)} for t in texts]
    assert gate.sizes[3:] == expected_sizes(gate), gate.sizes
    assert max(gate.sizes) == 32 and stats["inference_count"] == 3 + CLIENTS


def test_the_library_page_commands_run_the_flask_app_and_ask_it():
    """The commands under the example: it is saved as app.py and run, and curl asks it."""
    section = PAGE.read_text()
    block = re.search(r"```python\n.*?```.*?```bash\n(.*?)```", section, re.S)
    assert block, "the library page's commands for the Flask example are gone"
    install, run, curl = [shlex.split(line) for line in block.group(1).splitlines()]
    assert install == [".venv/bin/pip", "install", "flask"], install
    assert run == [".venv/bin/python", "app.py"] and "`app.py`" in section, run
    assert curl[:2] == ["curl", "-s"] and curl[2] == "localhost:5000/predict", curl
    headers = dict(curl[i + 1].split(": ", 1) for i, w in enumerate(curl) if w == "-H")
    body = curl[curl.index("-d") + 1]
    example = load_example("gate")
    with example.batched, wsgi_server(example.app) as base:  # app.run()'s port is 5000
        req = urllib.request.Request(f"{base}/predict", body.encode(), headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
    text_in = json.loads(body)["text"]
    assert answer == {"text": text_in, "length": len(text_in)}


# --- FastAPI, awaiting --------------------------------------------------------------


@contextlib.contextmanager
def uvicorn_server(app: Any) -> Iterator[str]:
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_fastapi_app_awaits_batched_calls_on_its_own_loop():
    from fastapi import FastAPI

    gate = Gate(lambda xs: [x * x for x in xs])
    batched: Batched[int, int] = Batched(gate, max_batch_size=32, timeout_ms=10_000)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with batched:  # on uvicorn's loop: no thread of its own
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/square/{x}")
    async def square(x: int) -> dict[str, int]:
        return {"y": await batched.acall(x)}

    async def clients(base: str) -> list[Any]:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> Any:
                async with s.get(f"{base}/square/{i}") as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["y"]

            for _ in range(3):  # run times for the latency model, as above
                assert await one(2) == 4
            gate.armed = True
            calls = asyncio.gather(*(one(i) for i in range(CLIENTS)))
            await asyncio.to_thread(hold_then_release, gate, batched)
            return await calls

    with uvicorn_server(app) as base:
        answers = asyncio.run(clients(base))
        assert not [t for t in threading.enumerate() if t.name.startswith("aserve-batched")]
    assert answers == [i * i for i in range(CLIENTS)]
    assert gate.sizes[3:] == expected_sizes(gate), gate.sizes


# --- errors: timeouts, a failing function -------------------------------------------


def test_a_call_past_its_timeout_raises_timeout_in_the_caller_running_or_queued():
    gate = Gate(lambda xs: [x + 1 for x in xs])
    with Batched(gate, max_batch_size=4, timeout_ms=30_000) as batched:
        assert batched(1) == 2
        gate.armed = True
        # Its batch runs past its timeout. The timeout is long enough for the batch to
        # start on a busy machine (the gate holds it from then on), short enough to wait.
        held = batched.submit(10, timeout_ms=2000)
        assert gate.entered.wait(30)
        queued = batched.submit(20, timeout_ms=100)  # waits behind the held batch
        with pytest.raises(Timeout, match="still running its batch") as running:
            held.result(30)
        with pytest.raises(TimeoutError, match="waiting in the queue"):
            queued.result(30)
        assert isinstance(running.value, TimeoutError)
        with pytest.raises(Timeout):
            batched(30, timeout_ms=50)  # the sync call, behind the same held batch

        async def awaited() -> None:
            with pytest.raises(Timeout):
                await batched.acall(40, timeout_ms=50)

        asyncio.run(awaited())
        gate.release.set()
        assert batched(5) == 6  # the held batch ends; later calls are served
        assert batched.stats()["timed_out"] == 4


def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_before_it_is_queued():
    calls: list[int] = []

    def record(xs: list[int]) -> list[int]:
        calls.extend(xs)
        return xs

    for bad in (math.inf, math.nan, 0, -5, True, "100"):
        with pytest.raises(ValueError, match=re.escape(f"(got {bad!r})")):
            Batched(record, timeout_ms=bad)
    with Batched(record) as batched:
        for bad in (math.inf, -math.inf, math.nan, 0, -1.0, True, "100"):
            want = f"timeout_ms must be a finite positive number (got {bad!r})"
            with pytest.raises(ValueError, match=re.escape(want)):
                batched(1, timeout_ms=bad)
            with pytest.raises(ValueError, match=re.escape(want)):
                batched.submit(2, timeout_ms=bad)
            with pytest.raises(ValueError, match=re.escape(want)):
                asyncio.run(batched.acall(3, timeout_ms=bad))
        assert calls == [] and batched.stats()["inference_count"] == 0  # nothing queued
        # Finite, however large: the call waits as long as a thread can, and is answered.
        assert batched(4, timeout_ms=1e308) == 4
        assert batched.submit(5, timeout_ms=10**400).result(30) == 5
        assert asyncio.run(batched.acall(6, timeout_ms=1e308)) == 6
        # numpy's numbers are numbers (its bool is no more a timeout than Python's).
        assert batched(7, timeout_ms=np.int64(5000)) == 7
        assert batched(8, timeout_ms=np.float32(5000.0)) == 8
        with pytest.raises(ValueError, match="timeout_ms must be a finite positive number"):
            batched(9, timeout_ms=np.bool_(True))
        assert calls == [4, 5, 6, 7, 8]


def test_a_function_that_raises_fails_only_its_batch():
    def flaky(xs: list[int]) -> list[int]:
        if 13 in xs:
            raise ValueError("unlucky input 13")
        return [x * 10 for x in xs]

    gate = Gate(flaky)
    with Batched(gate, max_batch_size=8) as batched:
        gate.armed = True
        first = batched.submit(1)
        assert gate.entered.wait(30)
        # Queued together behind the held batch: one batch of both.
        bad, mate = batched.submit(13), batched.submit(2)
        wait_until(lambda: batched.stats()["pending_request_count"] == 2, "both to queue")
        gate.release.set()
        assert first.result(30) == 10
        for fut in (bad, mate):
            with pytest.raises(BatchFailed, match="unlucky input 13") as failed:
                fut.result(30)
            assert isinstance(failed.value.__cause__, ValueError)
        assert gate.sizes == [1, 2]
        assert batched(3) == 30  # the next batch runs as usual

    with Batched(lambda xs: xs[:-1]) as short:  # one result too few
        with pytest.raises(BatchFailed, match="returned 0 results for a batch of 1"):
            short(1)


def test_a_closed_batched_refuses_calls_and_close_answers_what_is_queued():
    gate = Gate(lambda xs: xs)
    batched: Batched[int, int] = Batched(gate)
    assert batched(1) == 1
    gate.armed = True
    held = batched.submit(2)
    assert gate.entered.wait(30)
    queued = batched.submit(3)
    wait_until(lambda: batched.stats()["pending_request_count"] == 1, "the call to queue")
    closer = threading.Thread(target=batched.close)
    closer.start()
    with pytest.raises(Unavailable, match="unloading"):
        queued.result(30)
    gate.release.set()  # close lets the running batch finish
    closer.join(30)
    assert held.result(30) == 2
    with pytest.raises(Unavailable, match="closed"):
        batched(4)
    assert not [t for t in threading.enumerate() if t.name.startswith("aserve-batched")]


# --- worker processes ---------------------------------------------------------------


def test_a_worker_that_dies_fails_only_its_batch_and_is_restarted():
    with Batched("batched_fns:double", workers=2, max_batch_size=4, timeout_ms=60_000) as batched:
        first, second = batched.stats()["worker_pids"]
        assert os.getpid() not in (first, second)
        with frozen(first):
            held = batched.submit(21)  # the first free worker takes it, and is held
            wait_until(lambda: batched.stats()["running_batch_count"] == 1, "the held batch")
            with pytest.raises(BatchFailed, match=r"exited \(exit code 3\)"):
                batched(DIE)  # on the other worker, which dies
            assert not held.done()
        assert held.result(30) == 42  # the held batch was not failed with it
        wait_until(lambda: batched.stats()["restarts"] == 1, "the worker's restart")
        pids = batched.stats()["worker_pids"]
        assert first in pids and second not in pids and len(pids) == 2
        results = [batched.submit(i) for i in range(20)]
        assert [f.result(30) for f in results] == [2 * i for i in range(20)]


def test_values_cross_to_workers_as_msgpack_and_nothing_else():
    with Batched("batched_fns:describe", workers=1) as batched:
        value = {"text": "hi", "blob": b"\x00\xff", "n": [1, 2.5, None, True], "k": {"a": 1}}
        got = batched(value)
        assert got["value"] == value and got["pid"] != os.getpid()
        arr = np.arange(12, dtype=np.float32).reshape(3, 4)
        back = batched({"a": arr})["value"]["a"]
        assert back.dtype == np.float32 and np.array_equal(back, arr)
        assert batched((1, 2))["value"] == [1, 2]  # msgpack has lists, not tuples
        for bad, kind in (({1, 2}, "builtins.set"), ([object()], "builtins.object"),
                          (np.array([b"x", 1], dtype=object), "dtype object")):  # fmt: skip
            with pytest.raises(NotSendable, match=kind) as refused:
                batched(bad)
            assert isinstance(refused.value, TypeError)
            assert "never pickled" in str(refused.value) or "never pickles" in str(refused.value)
        assert batched.stats()["inference_count"] == 3  # the refused never reached the queue

    with Batched("batched_fns:unsendable", workers=1) as batched:
        with pytest.raises(BatchFailed, match=r"result 0 of .* holds a builtins.set"):
            batched(1)
    with pytest.raises(TypeError, match="by import path"):
        Batched(lambda xs: xs, workers=2)
    with pytest.raises(ValueError, match="cannot find module 'no_such_module'"):
        Batched("no_such_module:predict", workers=2)
    with pytest.raises(ValueError, match="'gpu:0' is not a device"):
        Batched("batched_fns:double", workers=2, devices=["gpu:0"])
    with pytest.raises(ValueError, match="give workers=N"):
        Batched(lambda xs: xs, devices=["cuda:0", "cuda:1"])


def test_a_class_with_load_and_predict_stacks_arrays_in_workers_and_in_process():
    for workers in (0, 1):
        with Batched("batched_fns:Scaler", workers=workers, stack=True) as batched:
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            y = batched(x)
            assert y.dtype == np.float32 and np.array_equal(y, x * 3)
            # Another shape is batched apart from the first, never stacked with it.
            futs = [batched.submit(np.ones(n, np.float32)) for n in (2, 5, 2)]
            assert [f.result(30).tolist() for f in futs] == [[3.0] * 2, [3.0] * 5, [3.0] * 2]
            with pytest.raises(TypeError, match="stack=True"):
                batched(["not", "numbers"])


def test_workers_spread_over_devices_each_load_on_its_own():
    spread_check(["cpu", "cpu"], workers=4)
    assert spread(5, ["cuda:0", "cuda:1"]) == [("cuda:0", 3), ("cuda:1", 2)]


def spread_check(devices: list[str], workers: int) -> None:
    """Every worker serves, each on the device it was given (worker i on devices[i % n])."""
    with Batched("batched_fns:Where", workers=workers, devices=devices, max_batch_size=1) as b:
        pids = b.stats()["worker_pids"]
        assert len(pids) == workers
        with contextlib.ExitStack() as held:
            for pid in pids:
                held.enter_context(frozen(pid))
            # One call per worker: with batches of one, each frozen worker takes one.
            futs = [b.submit(i, timeout_ms=60_000) for i in range(workers)]
            wait_until(lambda: b.stats()["running_batch_count"] == workers, "a batch each")
        answers = [f.result(30) for f in futs]
    assert sorted(a["pid"] for a in answers) == sorted(pids)
    want = sorted(devices[i % len(devices)] for i in range(workers))
    assert sorted(a["device"] for a in answers) == want


@pytest.mark.gpu
def test_workers_spread_over_cuda_devices():
    """bench/gpu_check.sh runs this where a GPU is lent: two workers per CUDA device,
    each loading its model on the device it was given."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU; this torch ({torch.__version__}) sees none")
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    spread_check(devices, workers=2 * len(devices))


def test_import_aserve_stays_light():
    code = "import aserve, sys; aserve.Batched; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, check=True)  # fmt: skip
    assert out.stdout.strip() == "False"
    assert aserve.Batched is Batched


def test_a_cancelled_await_leaves_the_queue():
    gate = Gate(lambda xs: xs)

    async def main() -> None:
        async with Batched(gate, timeout_ms=30_000) as batched:  # on this loop
            assert await batched.acall(1) == 1
            gate.armed = True
            held = asyncio.ensure_future(batched.acall(2))
            await asyncio.to_thread(gate.entered.wait, 30)
            waiting = asyncio.ensure_future(batched.acall(3))
            queued = lambda: batched.stats()["pending_request_count"] == 1  # noqa: E731
            await asyncio.to_thread(wait_until, queued, "the call to queue")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            stats = batched.stats()
            assert stats["pending_request_count"] == 0 and stats["cancelled"] == 1
            gate.release.set()
            assert await held == 2
        assert gate.sizes == [1, 1]  # the cancelled call never ran

    asyncio.run(main())


def test_an_app_that_exits_without_close_stops_its_workers(tmp_path: Path):
    script = tmp_path / "app.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import aserve\n"
        "batched = aserve.Batched('batched_fns:double', workers=2)\n"
        "if __name__ == '__main__':\n"
        "    print(batched(4), *batched.stats()['worker_pids'], flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90, cwd=tmp_path, check=True)  # fmt: skip
    first, *pids = out.stdout.split()
    assert first == "8" and len(pids) == 2
    wait_until(lambda: not any(psutil.pid_exists(int(p)) for p in pids), "the workers to exit")
