"""A device memory budget on a real server: models loaded at their first request,
idle ones evicted (the one cheapest to evict first, by request counts; or least
recently used first), the budget never passed.

The servers run in the test's process (``inprocess.in_process``), so what the
budget measures (the process's resident set) is this process's. The models
hold a known amount of memory, far above the measure's noise: TorchScript
files of one 64 MiB weight each (a footprint is never taken as less than
its weights' file), and python handlers (``handlers/ballast.py``) that fill
a given number of MiB at load. With 64 MiB models a first load is assumed to
need about 78 MiB (``estimate_footprint_mib``) and measures 64 and a little;
a budget of 190 MiB holds two loaded, not three, and has room for a first
load beside one. Every order below comes from the server's state (its index, its
statistics, files a handler touched), never from a sleep or a duration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import tritonclient.grpc.aio as grpcclient
import tritonclient.http.aio as httpclient
from conftest import HANDLERS
from inprocess import InProcessServer, in_process

from aserve.config import ConfigError, parse_config
from aserve.sched.eviction import estimate_footprint_mib
from aserve.server import Server, StartupError

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
WEIGHT_MIB = 64
BUDGET_MIB = 190  # two 64 MiB models and a little, not three; a first load (78) beside one


class Weights(torch.nn.Module):
    """``Y = X + w[:4]`` with one weight of ``mib`` MiB, every element ``value``."""

    def __init__(self, mib: int, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((mib * MIB // 4,), value), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[:4]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``w1.pt`` .. ``w4.pt``, 64 MiB of weights each (value k), and ``bad.pt``."""
    folder = tmp_path_factory.mktemp("weights")
    for k in range(1, 5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            torch.jit.script(Weights(WEIGHT_MIB, float(k))).save(str(folder / f"w{k}.pt"))
    (folder / "bad.pt").write_bytes(b"not a TorchScript archive" * 100)
    return folder


@pytest.fixture
def folder(tmp_path: Path, weights: Path) -> Path:
    for f in weights.iterdir():
        os.symlink(f, tmp_path / f.name)
    for handler in ("ballast.py", "gated.py"):
        shutil.copy(HANDLERS / handler, tmp_path / handler)
    return tmp_path


def torch_model(name: str, path: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "torch", "path": path, "load": "on_demand",
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
        "batching": {"max_batch_size": 4, "max_delay_ms": 0, "timeout_ms": 60_000},
        **extra,
    }  # fmt: skip


def ballast_model(name: str, folder: Path, mib: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "ballast:Ballast", "load": "on_demand",
        "parameters": {"mib": mib, "began": str(folder / f"{name}-began"),
                       "gate": str(folder / f"{name}-gate")},
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
        "batching": {"max_batch_size": 1, "max_delay_ms": 0, "timeout_ms": 60_000},
        **extra,
    }  # fmt: skip


def budget(
    mib: int = BUDGET_MIB, grpc: bool = False, eviction: str | None = None,
    park: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    cpu: dict[str, Any] = {"memory_budget_mib": mib}
    if eviction is not None:
        cpu["eviction"] = eviction
    if park is not None:
        cpu["park_evicted"] = park
    config: dict[str, Any] = {"devices": {"cpu": cpu}}
    if grpc:
        config["grpc"] = {"host": "127.0.0.1", "port": 0}
    return config


class Client:
    """What a test asks of the server over HTTP."""

    def __init__(self, session: aiohttp.ClientSession, srv: InProcessServer) -> None:
        self._session = session
        self.srv = srv
        self.base = srv.base

    async def infer(
        self, model: str, x: float = 1.0, width: int = 4, timeout_ms: int | None = None
    ) -> tuple[int, Any]:
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, width],
                            "data": [x] * width}]}  # fmt: skip
        headers = {} if timeout_ms is None else {"aserve-timeout-ms": str(timeout_ms)}
        async with self._session.post(
            f"{self.base}/v2/models/{model}/infer", json=body, headers=headers
        ) as r:
            return r.status, await r.json()

    async def index(self) -> dict[str, dict[str, Any]]:
        async with self._session.post(f"{self.base}/v2/repository/index", json={}) as r:
            assert r.status == 200
            return {m["name"]: m for m in await r.json()}

    async def stats(self, model: str) -> dict[str, Any]:
        async with self._session.get(f"{self.base}/v2/models/{model}/stats") as r:
            assert r.status == 200
            return (await r.json())["model_stats"][0]

    async def metrics(self) -> str:
        async with self._session.get(f"{self.base}/metrics") as r:
            return await r.text()

    def used_mib(self) -> float:
        """What the budgeted device holds, as the server measured it."""
        (cpu,) = [d for d in self.srv.server.memory.snapshot()["devices"] if d["name"] == "cpu"]
        return float(cpu["used_mib"])

    async def until_stats(self, model: str, condition: Callable[[dict[str, Any]], bool]) -> None:
        """Poll the model's statistics until ``condition(stats)`` holds."""
        deadline = time.monotonic() + 60
        while not condition(stats := await self.stats(model)):
            assert time.monotonic() < deadline, f"never held; the statistics: {stats}"
            await asyncio.sleep(0.005)

    async def until(self, condition: Callable[[dict[str, dict[str, Any]]], bool]) -> None:
        """Poll the repository index until ``condition(index)`` holds."""
        deadline = time.monotonic() + 60
        while True:
            index = await self.index()
            if condition(index):
                return
            assert time.monotonic() < deadline, f"never held; the index: {index}"
            await asyncio.sleep(0.01)


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def _state(index: dict[str, dict[str, Any]], name: str) -> tuple[str, str]:
    return index[name]["state"], index[name]["reason"]


# --- loading at the first request -----------------------------------------------


async def test_first_request_loads_the_model_and_waits_for_it(folder: Path) -> None:
    config = {**budget(), "models": [torch_model("a", "w1.pt")]}
    async with in_process(config, folder) as srv, aiohttp.ClientSession() as session:
        c = Client(session, srv)
        async with session.get(f"{c.base}/v2/health/ready") as r:
            assert r.status == 200  # ready without the on-demand model
        state, reason = _state(await c.index(), "a")
        assert state == "UNAVAILABLE" and reason.startswith("not loaded")
        status, body = await c.infer("a", 1.0)
        assert status == 200, body
        assert body["outputs"][0]["data"] == [2.0, 2.0, 2.0, 2.0]  # x + w (all 1.0)
        index = await c.index()
        assert _state(index, "a") == ("READY", "")
        memory = index["a"]["memory"]
        assert memory["loads"] == {"ok": 1, "failed": 0, "cancelled": 0}
        # Never less than the 64 MiB of weights the file holds.
        assert memory["footprint_mib"] >= WEIGHT_MIB
        assert c.used_mib() <= BUDGET_MIB
        stats = await c.stats("a")
        assert stats["memory"]["state"] == "READY" and stats["memory"]["loads"]["ok"] == 1
        assert stats["inference_stats"]["success"]["count"] == 1


async def test_concurrent_requests_share_one_load(folder: Path) -> None:
    gate = folder / "load-gate"
    os.mkfifo(gate)
    gated = {
        "name": "g", "engine": "python", "handler": "gated:Gated", "load": "on_demand",
        "parameters": {"began": str(folder / "load-began"), "gate": str(gate)},
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
        "batching": {"max_batch_size": 8, "max_delay_ms": 0, "timeout_ms": 60_000},
    }  # fmt: skip
    async with in_process({**budget(), "models": [gated]}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2],
                                "data": [1.0, 2.0]}]}  # fmt: skip
            url = f"{c.base}/v2/models/g/infer"

            async def one() -> tuple[int, Any]:
                async with session.post(url, json=body) as r:
                    return r.status, await r.json()

            asks = [asyncio.ensure_future(one()) for _ in range(4)]
            await _until(lambda: (folder / "load-began").exists())
            # All four wait for the one load the first started (its handler's load holds).
            await c.until_stats("g", lambda s: s["memory"]["waiting_for_load"] == 4)
            state, reason = _state(await c.index(), "g")
            assert state == "UNAVAILABLE" and reason.startswith("loading")
            await asyncio.to_thread(lambda: open(gate, "wb").close())  # the load goes on
            answers = await asyncio.gather(*asks)
            assert [s for s, _ in answers] == [200] * 4
            assert all(b["outputs"][0]["data"] == [3.0] for _, b in answers)
            assert (await c.index())["g"]["memory"]["loads"]["ok"] == 1
            text = await c.metrics()
            assert 'aserve_model_loads_total{model="g",result="ok",version="1"} 1.0' in text


# --- eviction -----------------------------------------------------------------


# a is asked HOT times, then b once: b is the most recently used, a by far the
# most asked. Each model's cost to evict is its request rate times its mean
# load time; the loads are of one file size, so HOT to 1 decides it (a load
# of one of them taking HOT times another's would be needed to turn it).
HOT = 30


async def test_the_model_cheapest_to_evict_goes_and_the_budget_holds(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aserve.memory")
    models = [torch_model("a", "w1.pt"), torch_model("b", "w2.pt"), torch_model("c", "w3.pt")]
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            for name in ["a"] * HOT + ["b"]:
                status, body = await c.infer(name)
                assert status == 200, body
                assert c.used_mib() <= BUDGET_MIB
            index = await c.index()
            assert _state(index, "a") == ("READY", "") and _state(index, "b") == ("READY", "")
            rate_a = (await c.stats("a"))["memory"]["requests_per_s"]
            assert rate_a > (await c.stats("b"))["memory"]["requests_per_s"] > 0
            # c's load needs room: b leaves, the most recently used but asked once.
            status, body = await c.infer("c", 0.0)
            assert status == 200, body
            assert body["outputs"][0]["data"] == [3.0] * 4
            index = await c.index()
            assert _state(index, "a") == ("READY", "")
            assert _state(index, "c") == ("READY", "")
            assert _state(index, "b") == ("UNAVAILABLE", "evicted: to make room for model 'c/1'")
            assert index["b"]["memory"]["evictions"] == 1
            assert c.used_mib() <= BUDGET_MIB
            # b loads again at its next request, evicting c (asked once), not a.
            status, body = await c.infer("b", 0.0)
            assert status == 200 and body["outputs"][0]["data"] == [2.0] * 4
            index = await c.index()
            assert _state(index, "a") == ("READY", "")
            assert _state(index, "c")[1] == "evicted: to make room for model 'b/1'"
            assert index["b"]["memory"]["loads"]["ok"] == 2
            assert index["b"]["memory"]["restores"] == 0  # a CPU device does not park by default
            assert not any(e.parked for e in srv.server.memory.device("cpu").entries())
            assert index["a"]["memory"]["loads"]["ok"] == 1
            assert c.used_mib() <= BUDGET_MIB
            text = await c.metrics()
            assert 'aserve_model_evictions_total{model="b",version="1"} 1.0' in text
            assert 'aserve_model_evictions_total{model="c",version="1"} 1.0' in text
            assert 'aserve_model_evictions_total{model="a",version="1"} 0.0' in text
            assert 'aserve_model_state{model="c",state="UNAVAILABLE",version="1"} 1.0' in text
            assert 'aserve_model_state{model="b",state="READY",version="1"} 1.0' in text
            assert 'aserve_model_loads_total{model="b",result="ok",version="1"} 2.0' in text
            assert 'aserve_model_load_duration_seconds_count{model="b",version="1"} 2.0' in text
            ((_, budget_bytes),) = _samples(text, "aserve_device_memory_budget_bytes")
            assert budget_bytes == BUDGET_MIB * MIB
            footprints = _samples(text, "aserve_model_memory_footprint_bytes")
            assert {labels["model"] for labels, _ in footprints} == {"a", "b", "c"}
            assert all(value >= WEIGHT_MIB * MIB for _, value in footprints)
            ((_, used),) = _samples(text, "aserve_device_memory_used_bytes")
            assert used <= BUDGET_MIB * MIB
    messages = [r.getMessage() for r in caplog.records if r.name == "aserve.memory"]
    assert any(
        m.startswith("evicting model b/1 from cpu (costs least to evict: ") and "model c/1" in m
        for m in messages
    ), messages
    assert any(m.startswith("model c/1 loaded on cpu in ") and "(a request)" in m for m in messages)


async def test_lru_evicts_the_least_recently_used(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same requests on a device with "eviction": "lru": a leaves, asked HOT
    times but before b."""
    caplog.set_level(logging.INFO, logger="aserve.memory")
    models = [torch_model("a", "w1.pt"), torch_model("b", "w2.pt"), torch_model("c", "w3.pt")]
    async with in_process({**budget(eviction="lru"), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            for name in ["a"] * HOT + ["b", "c"]:
                status, body = await c.infer(name)
                assert status == 200, body
            index = await c.index()
            assert _state(index, "a") == ("UNAVAILABLE", "evicted: to make room for model 'c/1'")
            assert _state(index, "b") == ("READY", "") and _state(index, "c") == ("READY", "")
            assert c.used_mib() <= BUDGET_MIB
    messages = [r.getMessage() for r in caplog.records if r.name == "aserve.memory"]
    assert any(m.startswith("evicting model a/1 from cpu (least recently used;") for m in messages)


def test_eviction_names_its_rules() -> None:
    assert parse_config({"devices": {"cpu": {"eviction": "lru"}}}).devices["cpu"].eviction == "lru"
    assert parse_config({"devices": {"cpu": {}}}).devices["cpu"].eviction == "cost"
    with pytest.raises(ConfigError, match="eviction"):
        parse_config({"devices": {"cpu": {"memory_budget_mib": 10, "eviction": "lfu"}}})


async def test_a_resident_model_is_never_evicted(folder: Path) -> None:
    models = [
        torch_model("a", "w1.pt", resident=True), torch_model("b", "w2.pt"),
        torch_model("c", "w3.pt"),
    ]  # fmt: skip
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            for name in ("a", "b", "c"):  # a is the least recently used, but resident
                assert (await c.infer(name))[0] == 200
            index = await c.index()
            assert _state(index, "a") == ("READY", "")
            assert _state(index, "b")[1] == "evicted: to make room for model 'c/1'"
            assert (await c.stats("a"))["memory"]["resident"] is True
            assert c.used_mib() <= BUDGET_MIB


async def test_startup_models_count_against_the_budget_and_stay(folder: Path) -> None:
    startup = {**torch_model("s", "w4.pt"), "load": "startup"}
    models = [startup, torch_model("a", "w1.pt"), torch_model("b", "w2.pt")]
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            index = await c.index()
            assert _state(index, "s") == ("READY", "")
            assert index["s"]["memory"]["footprint_mib"] >= WEIGHT_MIB
            for name in ("a", "b"):  # s is the least recently used, but never evicted
                assert (await c.infer(name))[0] == 200
            index = await c.index()
            assert _state(index, "s") == ("READY", "")
            assert _state(index, "a")[1] == "evicted: to make room for model 'b/1'"
            assert c.used_mib() <= BUDGET_MIB


async def test_startup_models_that_do_not_fit_stop_the_start(folder: Path) -> None:
    models = [{**torch_model(n, f), "load": "startup"} for n, f in (("s", "w1.pt"), ("t", "w2.pt"))]
    config = {**budget(100), "http": {"host": "127.0.0.1", "port": 0}, "models": models}
    server = Server(parse_config(config), folder)
    try:
        with pytest.raises(StartupError, match="memory_budget_mib 100") as caught:
            await server.start()
        assert "needs 64.0 MiB on cpu" in str(caught.value)  # its files: never evicted
    finally:
        await server.stop()


async def test_a_busy_model_is_never_evicted(folder: Path) -> None:
    # h holds 64 MiB and a request of the test's; b is idle. c's load needs room:
    # h is the least recently used, but busy.
    models = [ballast_model("h", folder, WEIGHT_MIB), torch_model("b", "w2.pt"),
              torch_model("c", "w3.pt")]  # fmt: skip
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            held = asyncio.ensure_future(c.infer("h", 7.0, width=1))
            await _until(lambda: (folder / "h-began-7").exists())  # running in h's handler
            assert (await c.infer("b"))[0] == 200
            assert (await c.infer("c"))[0] == 200
            index = await c.index()
            assert _state(index, "h") == ("READY", "")
            assert _state(index, "b")[1] == "evicted: to make room for model 'c/1'"
            assert c.used_mib() <= BUDGET_MIB
            (folder / "h-gate").touch()
            status, body = await held
            assert status == 200 and body["outputs"][0]["data"] == [7.0]


async def test_loads_on_a_budgeted_device_run_one_at_a_time(folder: Path) -> None:
    """g's load holds the device (its handler waits for a file); a's request comes
    meanwhile and waits for a load of its own, which begins only after g's."""
    g = ballast_model("g", folder, 8)
    g["parameters"]["load_gate"] = str(folder / "g-load-gate")
    models = [g, torch_model("a", "w1.pt")]
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            first = asyncio.ensure_future(c.infer("g", -1.0, width=1))
            await _until(lambda: (folder / "g-began-load").exists())
            second = asyncio.ensure_future(c.infer("a"))
            await c.until_stats("a", lambda s: s["memory"]["waiting_for_load"] == 1)
            index = await c.index()
            assert index["g"]["reason"].startswith("loading")
            assert index["a"]["reason"].startswith("loading")
            # a's load waits for the device's lock: nothing of it ran yet.
            assert srv.server.memory.device("cpu").count.loading == 1
            assert index["a"]["memory"]["loads"] == {"ok": 0, "failed": 0, "cancelled": 0}
            (folder / "g-load-gate").touch()
            assert (await first)[0] == 200
            status, body = await second
            assert status == 200 and body["outputs"][0]["data"] == [2.0] * 4
            index = await c.index()
            assert _state(index, "g") == ("READY", "") and _state(index, "a") == ("READY", "")
            assert index["g"]["memory"]["footprint_overlapped"] is False
            assert index["a"]["memory"]["footprint_overlapped"] is False


async def test_an_evicted_model_is_parked_and_its_weights_read_back(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With park_evicted, an evicted TorchScript model releases its weights and
    keeps its module: its next load reads them back (a restore, no fresh load),
    the same answers, the rest it keeps counted against the budget; its file
    changed meanwhile, it is loaded anew."""
    caplog.set_level(logging.INFO, logger="aserve")
    original = (folder / "w2.pt").resolve()
    (folder / "w2.pt").unlink()
    shutil.copy(original, folder / "w2.pt")  # a copy of its own: touched below
    models = [torch_model("a", "w1.pt"), torch_model("b", "w2.pt"), torch_model("c", "w3.pt")]
    async with in_process({**budget(park=True), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            for name in ["a"] * HOT + ["b", "c"]:  # c's load evicts b, asked once
                status, body = await c.infer(name)
                assert status == 200, body
            index = await c.index()
            assert _state(index, "b")[1] == "evicted: to make room for model 'c/1'"
            (entry,) = [e for e in srv.server.memory.device("cpu").entries() if e.parked]
            assert entry.record.label == "b/1" and entry.footprint_mib < 2  # its module alone
            assert c.used_mib() <= BUDGET_MIB
            # b again: c leaves, b's weights are read back into its kept module.
            status, body = await c.infer("b", 0.0)
            assert status == 200 and body["outputs"][0]["data"] == [2.0] * 4
            memory = (await c.index())["b"]["memory"]
            assert memory["loads"]["ok"] == 2 and memory["restores"] == 1
            assert memory["footprint_mib"] >= WEIGHT_MIB
            assert c.used_mib() <= BUDGET_MIB
            text = await c.metrics()
            assert 'aserve_model_restores_total{model="b",version="1"} 1.0' in text
            assert 'aserve_model_restores_total{model="a",version="1"} 0.0' in text
            # Evicted again, then its file changes: loaded anew, not read back.
            status, body = await c.infer("c", 0.0)
            assert status == 200 and body["outputs"][0]["data"] == [3.0] * 4
            assert (await c.index())["b"]["state"] == "UNAVAILABLE"
            st = (folder / "w2.pt").stat()
            os.utime(folder / "w2.pt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            status, body = await c.infer("b", 0.0)
            assert status == 200 and body["outputs"][0]["data"] == [2.0] * 4
            memory = (await c.index())["b"]["memory"]
            assert memory["loads"]["ok"] == 3 and memory["restores"] == 1
            assert c.used_mib() <= BUDGET_MIB
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("model b/1 parked on cpu: 64.0 MiB of weights released") for m in messages
    )
    assert any("its weights read back into the kept module" in m for m in messages)
    assert any(
        m.startswith("model b/1 is loaded anew: the model file w2.pt changed") for m in messages
    )


# --- failures -----------------------------------------------------------------


async def test_a_load_that_cannot_fit_fails_and_the_others_serve(folder: Path) -> None:
    # a is resident: with 100 MiB, nothing can make room for b beside it (its
    # estimate, 78 MiB, nor its files, 64).
    models = [torch_model("a", "w1.pt", resident=True), torch_model("b", "w2.pt")]
    async with in_process({**budget(100, grpc=True), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            assert (await c.infer("a"))[0] == 200
            status, body = await c.infer("b")
            assert status == 503
            need = f"needs {estimate_footprint_mib((folder / 'w2.pt').stat().st_size):.1f}"
            assert f"model 'b/1' failed to load: model 'b/1' {need} MiB on cpu" in body["error"]
            assert "memory_budget_mib 100" in body["error"] and "a/1" in body["error"]
            assert "(resident)" in body["error"]
            assert (await c.infer("a", 2.0))[0] == 200  # a serves on
            index = await c.index()
            assert _state(index, "a") == ("READY", "")
            state, reason = _state(index, "b")
            assert state == "UNAVAILABLE" and reason.startswith(f"failed: model 'b/1' {need}")
            assert index["b"]["memory"]["loads"]["failed"] == 1
            assert c.used_mib() <= 100
            # gRPC's index says the same.
            port = srv.server.grpc.addresses[0][1]  # type: ignore[union-attr]
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                models_ = (await client.get_model_repository_index(as_json=True))["models"]
            finally:
                await client.close()
            by_name = {m["name"]: m for m in models_}
            assert by_name["a"]["state"] == "READY"
            assert by_name["b"]["state"] == "UNAVAILABLE"
            assert by_name["b"]["reason"].startswith(f"failed: model 'b/1' {need}")


async def test_a_load_whose_estimate_cannot_fit_is_tried_on_its_files(folder: Path) -> None:
    # Beside the resident a, 136 MiB leave about 72: not b's estimate (78), but
    # its 64 MiB of weights, which is what it measures once loaded.
    models = [torch_model("a", "w1.pt", resident=True), torch_model("b", "w2.pt")]
    async with in_process({**budget(136), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            assert (await c.infer("a"))[0] == 200
            status, body = await c.infer("b", 0.0)
            assert status == 200, body
            index = await c.index()
            assert _state(index, "a") == ("READY", "") and _state(index, "b") == ("READY", "")
            assert c.used_mib() <= 136


async def test_a_footprint_above_its_estimate_makes_room_after_the_load(folder: Path) -> None:
    """h's folder holds a few KiB (assumed 16 MiB), its handler fills 64: once
    measured, the device holds more than its budget, and the idle a leaves."""
    models = [torch_model("a", "w1.pt"), ballast_model("h", folder, WEIGHT_MIB)]
    async with in_process({**budget(120), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            assert (await c.infer("a"))[0] == 200
            assert (await c.infer("h", -1.0, width=1))[0] == 200
            index = await c.index()
            assert _state(index, "h") == ("READY", "")
            assert _state(index, "a")[1] == "evicted: to make room for model 'h/1'"
            assert index["h"]["memory"]["footprint_mib"] >= WEIGHT_MIB
            assert c.used_mib() <= 120


async def test_a_footprint_above_its_estimate_that_cannot_fit_is_unloaded(folder: Path) -> None:
    models = [torch_model("a", "w1.pt", resident=True), ballast_model("h", folder, WEIGHT_MIB)]
    async with in_process({**budget(120), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            assert (await c.infer("a"))[0] == 200
            status, body = await c.infer("h", -1.0, width=1)
            assert status == 503
            assert "once loaded, more than the" in body["error"], body
            assert "memory_budget_mib 120" in body["error"]
            index = await c.index()
            assert _state(index, "a") == ("READY", "")
            assert _state(index, "h")[0] == "UNAVAILABLE"
            assert _state(index, "h")[1].startswith("failed: measured at ")
            assert c.used_mib() <= 120
            assert (await c.infer("a"))[0] == 200


async def test_a_bad_model_file_fails_its_waiting_requests(folder: Path) -> None:
    models = [torch_model("bad", "bad.pt"), torch_model("a", "w1.pt")]
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            answers = await asyncio.gather(*(c.infer("bad") for _ in range(3)))
            for status, body in answers:
                assert status == 503, body
                assert "bad/1" in body["error"] and "fail" in body["error"]
            index = await c.index()
            state, reason = _state(index, "bad")
            assert state == "UNAVAILABLE" and reason.startswith("failed: ")
            assert index["bad"]["memory"]["loads"]["ok"] == 0
            assert index["bad"]["memory"]["loads"]["failed"] >= 1
            assert (await c.infer("a"))[0] == 200  # the others serve
            async with session.get(f"{c.base}/v2/health/ready") as r:
                assert r.status == 200


# --- deadlines ------------------------------------------------------------------


async def test_a_deadline_shorter_than_the_load_is_refused_at_once(folder: Path) -> None:
    # Never loaded, a's load is estimated at 0.5 s and more: 100 ms cannot make it.
    async with in_process({**budget(), "models": [torch_model("a", "w1.pt")]}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            status, body = await c.infer("a", timeout_ms=100)
            assert status == 503, body
            error = body["error"]
            assert error.startswith("model 'a/1' is loading: ready in about ")
            assert "(at 20" in error and "after the request's deadline in 0.1" in error
            # The load it started goes on for the requests that come later.
            await c.until(lambda index: index["a"]["state"] == "READY")
            assert (await c.infer("a"))[0] == 200
            assert (await c.index())["a"]["memory"]["loads"]["ok"] == 1


# --- the repository API ---------------------------------------------------------


async def test_repository_load_pins_and_unload_unpins(folder: Path) -> None:
    models = [torch_model("a", "w1.pt"), torch_model("b", "w2.pt"), torch_model("c", "w3.pt")]
    async with in_process({**budget(grpc=True), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            http = httpclient.InferenceServerClient(srv.base.removeprefix("http://"))
            try:
                await http.load_model("a")  # loads now, and stays
                index = await c.index()
                assert _state(index, "a") == ("READY", "")
                assert (await c.stats("a"))["memory"]["resident"] is True
                for name in ("b", "c"):  # a is the least recently used, but pinned
                    assert (await c.infer(name))[0] == 200
                index = await c.index()
                assert _state(index, "a") == ("READY", "")
                assert _state(index, "b")[1] == "evicted: to make room for model 'c/1'"
                assert index["a"]["memory"]["loads"]["ok"] == 1
                # A second load of a loaded model keeps it as it is.
                await http.load_model("a")
                assert (await c.index())["a"]["memory"]["loads"]["ok"] == 1
                await http.unload_model("a")
                by_name = {m["name"]: m for m in await http.get_model_repository_index()}
                assert by_name["a"]["state"] == "UNAVAILABLE"
                assert by_name["a"]["reason"] == "unloaded"
                status, _ = await c.infer("a")
                assert status == 404  # out of routing until loaded again
                await c.until(lambda index: c.used_mib() <= WEIGHT_MIB * 1.5)
                # Loaded again, pinned again: b's load now evicts c, not a.
                await http.load_model("a")
                assert (await c.infer("b"))[0] == 200
                index = await c.index()
                assert _state(index, "a") == ("READY", "")
                assert _state(index, "c")[1] == "evicted: to make room for model 'b/1'"
                assert c.used_mib() <= BUDGET_MIB
                port = srv.server.grpc.addresses[0][1]  # type: ignore[union-attr]
                grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
                try:
                    ready = await grpc.get_model_repository_index(as_json=True)
                    is_ready = await grpc.is_model_ready("c")
                finally:
                    await grpc.close()
                states = {m["name"]: (m["state"], m.get("reason", "")) for m in ready["models"]}
                assert states["a"] == ("READY", "")
                assert states["c"] == ("UNAVAILABLE", "evicted: to make room for model 'b/1'")
                assert is_ready  # evicted, it takes requests: the next one loads it
            finally:
                await http.close()


async def test_an_on_demand_model_without_a_budget_loads_once_and_stays(folder: Path) -> None:
    models = [torch_model("a", "w1.pt"), torch_model("b", "w2.pt"), torch_model("c", "w3.pt")]
    async with in_process({"models": models}, folder) as srv, aiohttp.ClientSession() as session:
        c = Client(session, srv)
        for name in ("a", "b", "c", "a"):
            assert (await c.infer(name))[0] == 200
        index = await c.index()
        assert all(_state(index, n) == ("READY", "") for n in "abc")
        assert index["a"]["memory"]["loads"]["ok"] == 1
        assert "aserve_device_memory_budget_bytes{" not in await c.metrics()


async def test_a_pipeline_step_loads_on_demand(folder: Path) -> None:
    spec = {"name": "X", "datatype": "FP32", "shape": [4]}
    pipeline = {
        "name": "p", "engine": "pipeline", "inputs": [spec],
        "outputs": [{**spec, "name": "Y"}], "steps": [{"model": "a"}],
        "batching": {"max_batch_size": 4, "timeout_ms": 60_000},
    }  # fmt: skip
    models = [pipeline, torch_model("a", "w1.pt")]
    async with in_process({**budget(), "models": models}, folder) as srv:
        async with aiohttp.ClientSession() as session:
            c = Client(session, srv)
            async with session.get(f"{c.base}/v2/models/p/ready") as r:
                assert r.status == 200  # its step takes requests: they load it
            assert _state(await c.index(), "a")[1].startswith("not loaded")
            status, body = await c.infer("p", 1.0)
            assert status == 200, body
            assert body["outputs"][0]["data"] == [2.0] * 4
            assert _state(await c.index(), "a") == ("READY", "")


def test_on_demand_needs_its_tensors_and_a_model_that_runs_batches() -> None:
    with pytest.raises(ConfigError, match="list them for a model with load 'on_demand'"):
        parse_config({"models": [{"name": "o", "engine": "onnx", "path": "m.onnx",
                                  "load": "on_demand"}]})  # fmt: skip
    with pytest.raises(ConfigError, match="load: 'on_demand' is for models that run batches"):
        parse_config({"models": [{"name": "p", "engine": "pipeline", "load": "on_demand",
                                  "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
                                  "outputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
                                  "steps": [{"model": "x"}]}]})  # fmt: skip


def _samples(text: str, family: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``family`` in a Prometheus text page: labels and value."""
    out = []
    for line in text.splitlines():
        if not line.startswith(family + "{"):
            continue
        labels_text, value = line[len(family) + 1 :].rsplit("} ", 1)
        labels = dict(part.split("=", 1) for part in labels_text.split(","))
        out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out
