"""The one Runtime contract: every runtime class keeps it, and the reloader asks each its own."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aserve.config import BatchingConfig, ModelConfig, parse_config
from aserve.errors import QueueFull
from aserve.library.core import Core
from aserve.loop.registry import ModelRegistry
from aserve.loop.reload import change_of
from aserve.loop.runtimes.base import DRAIN_POLL_S, Generator, Runtime, instance_group
from aserve.loop.runtimes.batched import ModelRuntime
from aserve.loop.runtimes.factory import create_runtime
from aserve.loop.runtimes.generation import GenerationRuntime
from aserve.loop.runtimes.handler import HandlerRuntime
from aserve.loop.runtimes.handler_threads import TimedStage
from aserve.loop.runtimes.pipeline import PipelineRuntime


def _t(name: str) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": [4]}


MODELS = [
    {"name": "enc", "engine": "torch", "path": "enc.pt", "inputs": [_t("X")],
     "outputs": [_t("Y")]},
    {"name": "hand", "engine": "python", "handler": "pkg.mod:Tok", "inputs": [_t("X")],
     "outputs": [_t("Y")]},
    {"name": "pipe", "engine": "pipeline", "inputs": [_t("X")], "outputs": [_t("Y")],
     "steps": [{"model": "enc"}]},
    {"name": "gen", "engine": "decoder", "path": "builtin:tiny-gpt2", "device": "cpu",
     "generation": {"max_num_seqs": 2, "max_model_len": 64}},
]  # fmt: skip
CLASSES = {
    "enc": ModelRuntime,
    "hand": HandlerRuntime,
    "pipe": PipelineRuntime,
    "gen": GenerationRuntime,
}


def _configs() -> dict[str, ModelConfig]:
    return {m.name: m for m in parse_config({"models": MODELS}).models}


async def _runtimes(tmp_path: Path) -> dict[str, Runtime]:
    # Created on a loop, as the server does; creating one loads nothing.
    registry = ModelRegistry()
    return {n: create_runtime(c, tmp_path, registry) for n, c in _configs().items()}


async def test_every_runtime_class_keeps_the_one_contract(tmp_path: Path) -> None:
    runtimes = await _runtimes(tmp_path)
    for name, rt in runtimes.items():
        assert type(rt) is CLASSES[name]
        assert isinstance(rt, Runtime) and not inspect.isabstract(type(rt))
        # What the registry, the reloader and the frontends read, before loading too.
        assert rt.label == f"{name}/1" and rt.state.value == "LOADING"
        assert not rt.ready and rt.not_ready_reason() == f"model '{name}/1' is not ready (LOADING)"
        assert not rt.busy and await rt.wait_idle(1.0)
        assert rt.worker_pids == []
        assert rt.metadata()["name"] == name and rt.triton_config()["name"] == name
        assert "inference_count" in rt.statistics()
        assert rt.input_specs and rt.default_timeout_s > 0
    # One drain, shared: no runtime waits its own way.
    assert all(type(rt).wait_idle is Runtime.wait_idle for rt in runtimes.values())
    assert DRAIN_POLL_S > 0


async def test_only_a_decoder_model_is_a_generator_and_only_a_handler_has_its_metrics(
    tmp_path: Path,
) -> None:
    runtimes = await _runtimes(tmp_path)
    # What the generation routes test, once, instead of the class that implements it.
    assert [n for n, rt in runtimes.items() if isinstance(rt, Generator)] == ["gen"]
    gen = runtimes["gen"]
    assert isinstance(gen, Generator) and gen.generation.max_model_len == 64 and gen.created > 0
    gen.end_streams()  # nothing to end before it is loaded
    # A declared member of the contract, not probed with getattr: None but for a
    # handler, whose metrics exist once it is loaded.
    assert [rt.handler_metrics for rt in runtimes.values()] == [None] * len(runtimes)
    assert type(runtimes["hand"]).handler_metrics is not Runtime.handler_metrics


async def test_the_batching_librarys_core_is_the_batched_runtime_not_a_copy() -> None:
    for workers, devices in ((0, ["cpu"]), (3, ["cpu", "cpu"])):
        core = Core("m:f", "my fn", BatchingConfig(), False, workers, devices)
        assert isinstance(core, ModelRuntime) and not inspect.isabstract(Core)
        # Its requests, batcher and stop are the server's batched runtime's own.
        for member in ("start", "infer", "_stop", "statistics"):
            assert getattr(Core, member) is getattr(ModelRuntime, member), member
        assert core.label == core.name == "my fn" and core.stats.name == "my fn"
        assert core.config.executor == ("process" if workers else "thread")
        assert core.config.instances == (2 if workers else 1)  # the first device's share


def test_a_runtime_that_misses_a_member_of_the_contract_cannot_be_made(tmp_path: Path) -> None:
    class Partial(Runtime):
        busy = False

        async def load(self) -> None: ...

        async def _stop(self) -> None: ...

        async def infer(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return {}

        def metadata(self) -> dict[str, Any]:
            return {}

        def triton_config(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="statistics"):
        Partial(_configs()["enc"], tmp_path)  # type: ignore[abstract]


async def test_a_pipeline_has_no_pool_or_batcher_and_a_handler_composes_a_batched_runtime(
    tmp_path: Path,
) -> None:
    runtimes = await _runtimes(tmp_path)
    assert not any(hasattr(runtimes["pipe"], a) for a in ("batcher", "_pool", "submit"))
    assert not issubclass(PipelineRuntime, ModelRuntime)
    assert not issubclass(HandlerRuntime, ModelRuntime)
    assert not hasattr(runtimes["hand"], "batcher")
    assert not issubclass(GenerationRuntime, ModelRuntime)


async def test_reload_asks_the_runtimes_own_class_what_applies_in_place(tmp_path: Path) -> None:
    runtimes = await _runtimes(tmp_path)
    configs = _configs()
    enc, gen = configs["enc"], configs["gen"]
    slower = enc.batching.model_copy(update={"max_delay_ms": 9.0})
    assert change_of(runtimes["enc"], enc.model_copy(update={"batching": slower})) == "reconfigure"
    assert change_of(runtimes["enc"], enc) == "keep"
    assert change_of(runtimes["enc"], enc, reload=True) == "replace"
    assert change_of(None, enc) == "add"
    # A decoder model takes nothing in place (GenerationRuntime.reconfigurable),
    # not even what a batched model would: the old static call said "in place".
    other = gen.model_copy(update={"batching": slower})
    assert ModelRuntime.reconfigurable(gen, other)
    assert not GenerationRuntime.reconfigurable(gen, other)
    assert change_of(runtimes["gen"], other) == "replace"
    assert change_of(runtimes["gen"], gen.model_copy(update={"cpu_threads": 2})) == "replace"
    # Pipelines and handlers keep the batched rule.
    for name in ("pipe", "hand"):
        cfg = configs[name]
        new = cfg.model_copy(
            update={"batching": cfg.batching.model_copy(update={"timeout_ms": 7.0})}
        )
        assert change_of(runtimes[name], new) == "reconfigure"
        runtimes[name].reconfigure(new)
        assert runtimes[name].default_timeout_s == pytest.approx(0.007)


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_the_engine_is_made_off_the_loop(tmp_path: Path, executor: str) -> None:
    """Making an engine imports its runtime (torch: a second or more): on the loop it
    held every other model's start and the listeners meanwhile."""
    made_on: list[threading.Thread] = []

    def engine(path: Path | None) -> Any:
        made_on.append(threading.current_thread())
        raise RuntimeError("no engine here")

    config = _configs()["hand"].model_copy(update={"executor": executor})
    with pytest.raises(RuntimeError, match="no engine here"):
        await ModelRuntime(config, tmp_path, engine=engine).start()
    assert made_on and made_on[0] is not threading.main_thread()


def test_one_instance_group_for_cpu_and_gpu() -> None:
    assert instance_group("m", 2, "cpu") == {"name": "m", "count": 2, "kind": "KIND_CPU"}
    assert instance_group("m", 1, "cuda:1") == {
        "name": "m", "count": 1, "kind": "KIND_GPU", "gpus": [1]
    }  # fmt: skip
    assert instance_group("m", 1, "cuda")["gpus"] == [0]


def test_a_stage_timed_on_handler_threads_is_read_on_the_loop_side() -> None:
    stage = TimedStage()
    barrier = threading.Barrier(4)

    def work(request: Any) -> int:
        barrier.wait(timeout=10)  # the four run at once
        return 7

    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(stage.call_threadsafe(work, None)))  # type: ignore[arg-type]
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [7, 7, 7, 7]
    assert stage.time.mean > 0


HELD_HANDLER = """
import os
import numpy as np


class Held:
    def load(self, context):
        self.entered = context.parameters["entered"]
        self.gate = context.parameters["gate"]

    def preprocess(self, request):
        with open(self.entered, "a") as f:
            f.write("x\\n")
        if request.parameters.get("hold"):
            with open(self.gate, "rb"):  # a FIFO: returns once the test opens it for writing
                pass
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        return {"y": batch["x"] + 1}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
"""


async def _poll(what: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if what():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_a_handler_request_in_preprocessing_holds_a_place_in_the_batched_queue(
    tmp_path: Path,
) -> None:
    (tmp_path / "held_preprocess.py").write_text(HELD_HANDLER)
    entered, gate = tmp_path / "entered", tmp_path / "gate"
    os.mkfifo(gate)
    config = parse_config(
        {"models": [{
            "name": "held", "engine": "python", "handler": "held_preprocess:Held",
            "inputs": [_t("X")], "outputs": [_t("Y")],
            "parameters": {"entered": str(entered), "gate": str(gate)},
            "batching": {"max_batch_size": 4, "max_queue_size": 2, "max_delay_ms": 0},
        }]},
        base_dir=tmp_path,
    ).models[0]  # fmt: skip
    rt = create_runtime(config, tmp_path, ModelRegistry())
    await rt.load()

    def infer(hold: bool, timeout_s: float = 30.0) -> Any:
        x = np.ones((1, 4), np.float32)
        return rt.infer({"X": x}, 1, (), timeout_s, parameters={"hold": True} if hold else None)

    def release() -> None:
        # Opening the FIFO's other end lets every preprocess blocked on it go on.
        with contextlib.suppress(OSError):  # ENXIO: none is blocked on it
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))

    try:
        held = [asyncio.ensure_future(infer(hold=True)) for _ in range(2)]
        await _poll(lambda: entered.exists() and len(entered.read_text().split()) == 2)
        # Two wait in preprocessing, none in the queue: the queue of 2 is full for a third,
        # which is refused before it is preprocessed.
        with pytest.raises(QueueFull, match=r"2 requests waiting \(max_queue_size 2\)"):
            await infer(hold=False, timeout_s=5.0)
        assert len(entered.read_text().split()) == 2
        release()
        for answer in await asyncio.wait_for(asyncio.gather(*held), 30):
            assert answer["Y"].tolist() == [[2.0] * 4]
        # Their places are given back: a request is served again.
        assert (await asyncio.wait_for(infer(hold=False), 30))["Y"].tolist() == [[2.0] * 4]
    finally:
        release()  # else a failed check leaves handler threads that unload waits for
        await rt.unload()
