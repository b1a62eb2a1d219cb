"""Small helpers for talking to a test server: aiohttp (async) and urllib (sync)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import orjson
import psutil
import tritonclient.grpc as grpcclient

from aserve.engines import builtin


def v2_body(
    name: str, data: list[Any], shape: list[int], datatype: str = "FP32", **extra: Any
) -> dict:
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}], **extra}


async def stats(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, Any]:
    async with session.get(f"{base}/v2/models/{model}/stats") as r:
        assert r.status == 200
        return (await r.json())["model_stats"][0]


async def wait_for_stats(
    session: aiohttp.ClientSession, base: str, model: str, check: Any, timeout: float = 20.0
) -> dict[str, Any]:
    """Poll the model's statistics until ``check(stats)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        s = await stats(session, base, model)
        if check(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached; last stats: {s}")
        await asyncio.sleep(0.02)


async def wait_idle(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, Any]:
    return await wait_for_stats(
        session, base, model,
        lambda s: s["pending_request_count"] == 0 and s["running_batch_count"] == 0,
    )  # fmt: skip


def sync_stats(base: str, model: str) -> dict[str, Any]:
    """The model's statistics over HTTP, for tests that are not async."""
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:
        return orjson.loads(r.read())["model_stats"][0]


def sync_wait_for_stats(base: str, model: str, check: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Poll the model's statistics until ``check(stats)`` holds (blocking)."""
    deadline = time.monotonic() + timeout
    while True:
        s = sync_stats(base, model)
        if check(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached; last stats: {s}")
        time.sleep(0.02)


def mixed_arrays(seed: int = 5) -> dict[str, np.ndarray]:
    """One [2, 3] array per input of the "mixed" model (suffixes of IN_*/OUT_*)."""
    rng = np.random.default_rng(seed)
    return {
        "FLAGS": np.array([[True, False, True], [False, False, True]]),
        "SMALL": rng.integers(-60, 60, (2, 3)).astype(np.int8),
        "BIG": rng.integers(-(2**40), 2**40, (2, 3)).astype(np.int64),
        "HALF": rng.standard_normal((2, 3)).astype(np.float16),
        "DOUBLE": rng.standard_normal((2, 3)).astype(np.float64),
        "OCTETS": rng.integers(0, 250, (2, 3)).astype(np.uint8),
    }


def grpc_input(name: str, arr: np.ndarray) -> grpcclient.InferInput:
    """A tritonclient.grpc input holding ``arr`` (sent raw, as tritonclient always does)."""
    inp = grpcclient.InferInput(name, list(arr.shape), grpcclient.np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Hold a worker process stopped (SIGSTOP) until the block ends, then let it go on.

    A batch the server hands to a frozen worker stays running for exactly as
    long as the test wants, on a machine of any speed: the test, not a spin
    count, decides when the model is busy and when it is done.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        # The stop takes effect asynchronously: wait until the kernel says so.
        proc = psutil.Process(pid)
        deadline = time.monotonic() + 10
        while proc.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, f"worker {pid} did not stop"
            time.sleep(0.005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def resolve_in_threads(name: str, count: int) -> list[Any]:
    """Call the builtin model ``resolve(name)`` on ``count`` threads released together; their results."""
    start = threading.Barrier(count, timeout=30)
    results: list[Any] = [None] * count

    def build(i: int) -> None:
        start.wait()
        try:
            results[i] = builtin.resolve(name)
        except Exception as exc:  # the test reports every builder's failure
            results[i] = exc

    threads = [threading.Thread(target=build, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a builder never finished"
    return results


class StandInEngine:
    """What an executor needs of an engine, for executor tests that must hold or
    break a batch at will: instances are their index, inputs ``X`` stacked, outputs
    not checked. Subclasses give ``run`` (and ``inline_capable`` True to let tiny
    batches run on the loop)."""

    inline_capable = False

    def create_instance(self, index: int) -> Any:
        return index

    def stack_inputs(self, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {"X": np.concatenate([p["X"] for p in parts])}

    def check_outputs(self, outputs: dict[str, np.ndarray], batch_size: int) -> None:
        pass
