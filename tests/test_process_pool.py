"""Batched models with ``"executor": "process"``: the instances run in worker
processes, answer as threads would, and a worker that dies is replaced while
the server goes on serving."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
import pytest
import torch
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from helpers import frozen
from reload_helpers import copy_handler, wait_log

from aserve.commands import run
from aserve.config import ConfigError, ModelConfig, parse_config
from aserve.engines.python_handler import PythonHandlerEngine
from aserve.loop.runtimes.handler import HandlerRuntime
from aserve.workers import supervisor
from aserve.workers.batch_process import ProcessPool, WorkerSpec
from aserve.workers.job import BatchJob
from aserve.workers.wire import WireError, pack_arrays, unpack_arrays

pytestmark = pytest.mark.timeout(120)

EXIT, KILL = -999.0, -777.0


def probe_model(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "worker_probe:Probe", "executor": "process",
        "inputs": [spec("X", "FP32", [2])],
        "outputs": [spec("Y", "FP32", [2]), spec("PID", "INT64", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 1}, **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def procs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("process-pool")
    copy_handler(folder, "worker_probe")
    affine = {
        "inputs": [spec("INPUT0", "FP32", [16])], "outputs": [spec("OUTPUT0", "FP32", [16])],
        "batching": {"max_batch_size": 8, "max_delay_ms": 2.0},
    }  # fmt: skip
    models = [
        model_entry(
            "affine_proc", str(model_dir / "affine.pt"), executor="process", instances=2, **affine
        ),
        model_entry("affine_thread", str(model_dir / "affine.pt"), **affine),
        probe_model("probe"),
    ]
    srv = start_server(write_config(folder, {"models": models}))
    yield srv
    srv.stop()


def affine_body(rows: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "shape": list(rows.shape), "datatype": "FP32",
                        "data": rows.reshape(-1).tolist()}]}  # fmt: skip


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def probe(session: aiohttp.ClientSession, base: str, x: float) -> tuple[int, Any]:
    body = {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [x, 1.0]}]}
    return await post(session, f"{base}/v2/models/probe/infer", body)


async def wait_ready(session: aiohttp.ClientSession, base: str, model: str) -> None:
    for _ in range(1500):
        async with session.get(f"{base}/v2/models/{model}/ready") as r:
            if r.status == 200:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"model {model} never became ready again")


async def test_process_and_thread_instances_answer_alike(
    procs: ServerProcess, eager_models: dict[str, Any]
) -> None:
    rng = np.random.default_rng(5)
    batches = [rng.standard_normal((int(rng.integers(1, 4)), 16)).astype(np.float32)
               for _ in range(48)]  # fmt: skip
    async with aiohttp.ClientSession() as session:
        answers = {}
        for model in ("affine_proc", "affine_thread"):
            url = f"{procs.base}/v2/models/{model}/infer"
            answers[model] = await asyncio.gather(
                *(post(session, url, affine_body(b)) for b in batches)
            )
        async with session.get(f"{procs.base}/v2/models/affine_proc/stats") as r:
            stats = (await r.json())["model_stats"][0]
        async with session.get(f"{procs.base}/v2/dashboard/stats") as r:
            dashboard = await r.json()
    pairs = zip(answers["affine_proc"], answers["affine_thread"], strict=True)
    for rows, ((s1, d1), (s2, d2)) in zip(batches, pairs, strict=True):
        assert s1 == s2 == 200
        # Close, not equal: the batches (and so the matmul kernels) differ between the two.
        np.testing.assert_allclose(d1["outputs"][0]["data"], d2["outputs"][0]["data"], rtol=1e-5)
        with torch.no_grad():
            want = eager_models["affine"](torch.from_numpy(rows)).numpy().reshape(-1)
        np.testing.assert_allclose(d1["outputs"][0]["data"], want, rtol=1e-5, atol=1e-5)
    # Concurrent requests were batched together in the workers.
    assert stats["execution_count"] < stats["inference_count"]
    # Two affine workers and the probe's: counted in the dashboard's process figures.
    assert dashboard["process"]["child_processes"] == 3
    assert len(procs.spawned_children()) == 3


async def test_handler_infer_runs_in_a_worker_and_the_rest_in_the_server(
    procs: ServerProcess,
) -> None:
    async with aiohttp.ClientSession() as session:
        status, doc = await probe(session, procs.base, 1.5)
    assert status == 200, doc
    out = {o["name"]: o["data"] for o in doc["outputs"]}
    assert out["Y"] == [3.0, 2.0]
    pid = out["PID"][0]
    assert pid != procs.proc.pid
    assert pid in [p.pid for p in procs.spawned_children()]


def test_the_command_line_starts_the_workers_early_and_the_server_takes_them_over(
    procs: ServerProcess,
) -> None:
    """``python -m aserve`` starts each worker process before the server's own
    imports; the pool the server makes takes that child over (same pid), since it
    was started with what the pool would start it with."""
    first: dict[tuple[str, str], str] = {}
    for m in re.finditer(
        r"worker process (\d+) of '(\w+)' is up \(pid \d+(.*?)\)", procs.log_text()
    ):
        first.setdefault((m[2], m[1]), m[3])
    assert first == {
        ("affine_proc", "0"): ", started early",
        ("affine_proc", "1"): ", started early",
        ("probe", "0"): ", started early",
    }


async def test_a_worker_that_dies_is_replaced(procs: ServerProcess) -> None:
    base = procs.base
    async with aiohttp.ClientSession() as session:
        status, doc = await probe(session, base, 1.0)
        assert status == 200
        first = doc["outputs"][1]["data"][0]

        # SystemExit in infer: the worker exits, its batch fails with a reason.
        status, doc = await probe(session, base, EXIT)
        assert status == 500
        assert doc["error"].startswith(
            "model 'probe/1' failed: the worker process 0 of 'probe' exited (exit code 1): "
            "SystemExit: exit on purpose"
        ), doc
        await wait_ready(session, base, "probe")
        status, doc = await probe(session, base, 2.0)
        assert status == 200 and doc["outputs"][0]["data"] == [4.0, 2.0]
        second = doc["outputs"][1]["data"][0]
        assert second != first and not psutil.pid_exists(first)

        # Killed from outside while idle: not ready until the replacement is up.
        os.kill(second, signal.SIGKILL)
        for _ in range(500):
            async with session.get(f"{base}/v2/models/probe/ready") as r:
                if r.status != 200:
                    break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the model stayed ready with its worker killed")
        status, doc = await probe(session, base, 3.0)
        assert status in (200, 503), doc
        if status == 503:
            assert "its executor process died and is restarting" in doc["error"]
        await wait_ready(session, base, "probe")

        # Killed mid-batch (SIGKILL from inside infer): that batch fails, the next is served.
        status, doc = await probe(session, base, KILL)
        assert status == 500 and "exit code -9" in doc["error"], doc
        await wait_ready(session, base, "probe")
        status, doc = await probe(session, base, 4.0)
        assert status == 200 and doc["outputs"][0]["data"] == [8.0, 2.0]
        # The other models were served throughout.
        rows = np.ones((1, 16), np.float32)
        status, _ = await post(session, f"{base}/v2/models/affine_proc/infer", affine_body(rows))
        assert status == 200
    wait_log(procs, "worker process 0 of 'probe' is back (restart 3)")
    assert len(procs.spawned_children()) == 3
    assert procs.proc.poll() is None


async def test_with_one_of_two_workers_down_the_other_serves_and_the_model_stays_ready(
    tmp_path: Path,
) -> None:
    copy_handler(tmp_path, "worker_probe")
    hold = tmp_path / "hold"  # while it exists, a worker being started waits in its load
    model = probe_model("probe", instances=2, parameters={"hold_load_while": str(hold)})
    srv = start_server(write_config(tmp_path, {"models": [model]}))
    try:
        workers = {p.pid for p in srv.spawned_children()}
        assert len(workers) == 2
        victim = min(workers)
        (survivor,) = workers - {victim}
        hold.touch()
        os.kill(victim, signal.SIGKILL)
        # The restart is under way, and held there: the killed worker is gone and
        # its replacement has started but not loaded.
        for _ in range(3000):
            now = {p.pid for p in srv.spawned_children()}
            if victim not in now and len(now - workers) == 1:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"no replacement worker started: {now}")
        wait_log(srv, "of 'probe' exited (exit code -9); restarting it")
        async with aiohttp.ClientSession() as session:
            for round_ in range(3):
                answers = await asyncio.gather(
                    *(probe(session, srv.base, float(i)) for i in range(12))
                )
                for i, (status, doc) in enumerate(answers):
                    assert status == 200, (round_, doc)
                    out = {o["name"]: o["data"] for o in doc["outputs"]}
                    assert out["Y"] == [2.0 * i, 2.0] and out["PID"] == [survivor]
                for path in ("/v2/models/probe/ready", "/v2/health/ready"):
                    async with session.get(srv.base + path) as r:
                        assert r.status == 200, (path, await r.text())
            assert "is back" not in srv.log_text()  # all of that while the restart was held
            hold.unlink()
            wait_log(srv, "of 'probe' is back (restart 1)")
            status, _ = await probe(session, srv.base, 1.0)
            assert status == 200
    finally:
        hold.unlink(missing_ok=True)
        srv.stop()


def test_a_worker_that_cannot_load_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    copy_handler(tmp_path, "worker_probe")
    config = write_config(
        tmp_path, {"models": [probe_model("probe", parameters={"fail_in": "infer"})]}
    )
    done = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "model 'probe/1' failed to load: RuntimeError: cannot load in role infer" in done.stderr
    ), done.stderr


def _launch(config: Path) -> ServerProcess:
    """``python -m aserve`` on ``config`` without waiting for it to be ready (its
    load is held at a gate): the log is pumped into the returned server."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    srv = ServerProcess(proc, 0)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            srv.log.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m and not srv.port:
                srv.port = int(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    return srv


async def _open_gate(gate: Path, timeout: float = 60.0) -> None:
    """Let the front's load that waits on the FIFO ``gate`` go on (once it waits there)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or loop.time() > deadline:
                raise
        await asyncio.sleep(0.01)


async def test_the_worker_processes_load_while_the_front_does(tmp_path: Path) -> None:
    copy_handler(tmp_path, "worker_probe")
    gate = tmp_path / "front-gate"
    os.mkfifo(gate)
    model = probe_model("probe", instances=2, parameters={"front_gate": str(gate)})
    srv = _launch(write_config(tmp_path, {"models": [model]}))
    released = False
    try:
        # Both workers load and come up while the front's load is held at the gate.
        for i in range(2):
            await asyncio.to_thread(wait_log, srv, f"worker process {i} of 'probe' is up", 60)
        pids = {srv.worker_pid("probe", i) for i in range(2)}
        assert pids == {p.pid for p in srv.spawned_children()}
        assert srv.port, srv.log_text()  # bound before any model loads
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{srv.base}/v2/health/ready") as r:
                assert r.status == 503  # the front is still loading
            await _open_gate(gate)
            released = True
            await wait_ready(session, srv.base, "probe")
            status, doc = await probe(session, srv.base, 1.5)
        assert status == 200, doc
        out = {o["name"]: o["data"] for o in doc["outputs"]}
        assert out["Y"] == [3.0, 2.0] and out["PID"][0] in pids
        assert {p.pid for p in srv.spawned_children()} == pids  # the same two, not new ones
    finally:
        if not released:
            await _open_gate(gate, 5)
        srv.stop()


async def test_a_front_that_fails_stops_the_workers_it_started_beside_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aserve.executor")
    copy_handler(tmp_path, "worker_probe")
    gate = tmp_path / "front-gate"
    os.mkfifo(gate)
    parameters = {"front_gate": str(gate), "fail_in": "front"}
    runtime = HandlerRuntime(ModelConfig(**probe_model("probe", parameters=parameters)), tmp_path)
    loading = asyncio.ensure_future(runtime.load())
    try:
        # The worker is up, the front is held at its gate: then the front fails.
        for _ in range(6000):
            up = [r.getMessage() for r in caplog.records if "is up (pid " in r.getMessage()]
            if up or loading.done():
                break
            await asyncio.sleep(0.01)
        assert up, "the worker never came up while the front was loading"
        pid = int(up[0].rsplit("(pid ", 1)[1].rstrip(")"))
        assert psutil.pid_exists(pid)
    finally:
        await _open_gate(gate, 60)
    with pytest.raises(RuntimeError, match="cannot load in role front"):
        await asyncio.wait_for(loading, 60)
    # Nothing is left running: the worker that was up was stopped and reaped.
    assert not psutil.pid_exists(pid)
    assert runtime.worker_pids == []
    await runtime.unload()  # as the server does after a failed load: a no-op now


async def test_a_front_that_fails_while_its_worker_loads_stops_that_worker(
    tmp_path: Path,
) -> None:
    import multiprocessing

    copy_handler(tmp_path, "worker_probe")
    gate, hold = tmp_path / "front-gate", tmp_path / "hold"
    os.mkfifo(gate)
    hold.touch()  # the worker's load waits while it exists: it is still loading
    parameters = {"front_gate": str(gate), "fail_in": "front", "hold_load_while": str(hold)}
    runtime = HandlerRuntime(ModelConfig(**probe_model("probe", parameters=parameters)), tmp_path)
    loading = asyncio.ensure_future(runtime.load())
    try:
        for _ in range(6000):
            children = multiprocessing.active_children()
            if children or loading.done():
                break
            await asyncio.sleep(0.01)
        assert children, "no worker process started while the front was loading"
    finally:
        await _open_gate(gate, 60)
    try:
        with pytest.raises(RuntimeError, match="cannot load in role front"):
            await asyncio.wait_for(loading, 60)
        assert multiprocessing.active_children() == []  # reaped (killed in its load)
        assert not any(c.is_alive() for c in children)
    finally:
        hold.unlink()


def test_wire_round_trip_and_refusals() -> None:
    arrays = {
        "f": np.arange(6, dtype=np.float16).reshape(2, 3),
        "b": np.array([[True, False]]),
        "s": np.array([[b"ab", b""]], dtype=object),
        "t": np.asfortranarray(np.arange(4, dtype=np.int64).reshape(2, 2)),
        "e": np.zeros((0, 3), np.float32),
    }
    back = unpack_arrays(pack_arrays(arrays), writable=True)
    for name, arr in arrays.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        assert back[name].tolist() == arr.tolist()
        assert back[name].flags.writeable
    with pytest.raises(WireError, match="array 'o' holds a dict"):
        pack_arrays({"o": np.array([{}], dtype=object)})


def test_process_executor_is_for_torch_and_python_engines() -> None:
    with pytest.raises(ConfigError, match="executor: 'process' is for engines torch, python"):
        parse_config({"models": [{"name": "m", "engine": "onnx", "path": "m.onnx",
                                  "executor": "process"}]})  # fmt: skip


async def test_pipe_channel_reassembles_messages_split_across_writes() -> None:
    """The bug this channel replaced: Connection.recv_bytes on the loop's
    non-blocking fd failed on a message written in two parts (over 16 KiB)."""
    import multiprocessing
    import threading

    from aserve.workers.pipe import open_channel

    parent, child = multiprocessing.Pipe(duplex=True)
    got: list[bytes] = []
    closed = asyncio.Event()
    channel = await open_channel(parent, got.append, closed.set)
    sizes = [10, 20_000, 5_000_000, 0, 16_385]
    payloads = [bytes([i % 251]) * n for i, n in enumerate(sizes)]

    def child_side() -> None:
        for p in payloads:
            child.send_bytes(p)  # header and body in separate writes above 16 KiB
        echoed.append(child.recv_bytes())
        child.close()

    echoed: list[bytes] = []
    thread = threading.Thread(target=child_side)
    thread.start()
    channel.send(b"x" * 3_000_000)
    await asyncio.wait_for(closed.wait(), 10)
    thread.join(5)
    assert got == payloads
    assert echoed == [b"x" * 3_000_000]
    with pytest.raises(OSError):
        channel.send(b"after the end")


async def _pool(tmp_path: Path) -> ProcessPool:
    copy_handler(tmp_path, "worker_probe")
    config = ModelConfig(**probe_model("probe"))
    front = PythonHandlerEngine(config, None, tmp_path)
    pool = ProcessPool(WorkerSpec(config, None, str(tmp_path)), front, 1, "probe")
    await pool.start()
    return pool


def _job(x: float, done: Callable[[BatchJob], Any]) -> BatchJob:
    return BatchJob([{"x": np.array([[x, 1.0]], np.float32)}], 1, done)


async def test_batches_sent_while_the_worker_restarts_wait_for_it(tmp_path: Path) -> None:
    pool = await _pool(tmp_path)
    try:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[BatchJob] = loop.create_future()
        second: asyncio.Future[BatchJob] = loop.create_future()

        def killed(job: BatchJob) -> None:
            # What the batcher does when a batch fails: its slot is free again, and
            # the next batch is submitted at once, before the replacement is up.
            first.set_result(job)
            pool.submit(_job(2.0, second.set_result))

        pool.submit(_job(KILL, killed))
        failed = await asyncio.wait_for(first, 30)
        assert "exit code -9" in str(failed.error)
        assert pool.live == 0
        served = await asyncio.wait_for(second, 60)
        assert served.error is None, served.error
        assert served.outputs is not None
        assert served.outputs["y"].tolist() == [[4.0, 2.0]]
        assert served.outputs["y"].flags.writeable  # a postprocess may change it in place
        assert pool.live == 1 and pool.restarts == 1
    finally:
        await pool.stop()


async def test_stop_answers_the_batch_a_worker_is_running(tmp_path: Path) -> None:
    pool = await _pool(tmp_path)
    loop = asyncio.get_running_loop()
    running: asyncio.Future[BatchJob] = loop.create_future()
    pid = pool.pids[0]
    with frozen(pid):  # the batch is the worker's until it is let go, after stop began
        pool.submit(_job(3.0, running.set_result))
        stopping = asyncio.ensure_future(pool.stop())
        await asyncio.sleep(0)  # one pass of the loop: stop() runs until it waits for the exit
        assert not running.done()
    await asyncio.wait_for(stopping, 30)
    job = await asyncio.wait_for(running, 5)
    assert job.error is None and job.outputs is not None
    assert job.outputs["y"].tolist() == [[6.0, 2.0]]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    late: asyncio.Future[BatchJob] = loop.create_future()
    pool.submit(_job(1.0, late.set_result))
    assert "stopping" in str((await asyncio.wait_for(late, 5)).error)


def test_a_worker_that_cannot_be_started_early_is_left_to_the_models_own_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A spawn that fails before the server is built (no process to spare) must not
    stop the server from starting: the model's own start spawns it as usual."""

    def no_process(*args: Any) -> Any:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(supervisor, "start", no_process)
    config = parse_config({"models": [probe_model("probe")]})
    run.start_workers_early(config, tmp_path)  # does not raise
    assert "could not start the workers of 'probe' early" in caplog.text
