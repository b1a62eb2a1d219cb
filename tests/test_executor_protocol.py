"""Every executor the batchers are handed satisfies the one Executor protocol."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from conftest import spec

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.library.pools import DevicePools
from aserve.workers.batch_process import ProcessPool, WorkerSpec
from aserve.workers.job import (
    ChildProcesses,
    EngineHandle,
    Executor,
    Inline,
    RunAhead,
    SequenceCheck,
    Staging,
)
from aserve.workers.pinned_pool import PinnedPool
from aserve.workers.step_executor import StepExecutor
from aserve.workers.step_process import ProcessStepExecutor, WorkerArgs
from aserve.workers.thread_pool import ExecutorPool

pytestmark = pytest.mark.timeout(30)


class _Engine(Engine):
    def load(self) -> None:
        pass

    def run(self, inputs: dict[str, Any], instance: Any) -> dict[str, Any]:
        return inputs


def _executors(tmp_path: Path) -> list[Any]:
    config = ModelConfig(
        name="m", engine="python", handler="h:H",
        inputs=[spec("X", "FP32", [1])], outputs=[spec("Y", "FP32", [1])],
    )  # fmt: skip
    engine = _Engine(config, tmp_path)
    pool = ProcessPool(WorkerSpec(config, None, str(tmp_path)), engine, 2, "m")
    args = WorkerArgs(str(tmp_path), {}, "cpu", "float32", 1, "g")
    pinned = PinnedPool(engine, 2, "m")
    return [
        ExecutorPool(engine, 2, "m"),
        pool,
        DevicePools([pool]),
        StepExecutor(None, "g"),  # type: ignore[arg-type]  # nothing runs before start
        ProcessStepExecutor(args, on_lost=lambda _: None),
        pinned,
        pinned.instance(1),
    ]


def test_every_executor_is_an_executor(tmp_path: Path) -> None:
    for executor in _executors(tmp_path):
        assert isinstance(executor, Executor), type(executor).__name__


def test_every_executor_has_the_protocol_signatures(tmp_path: Path) -> None:
    for executor in _executors(tmp_path):
        name = type(executor).__name__
        assert inspect.iscoroutinefunction(executor.start), name
        assert inspect.iscoroutinefunction(executor.stop), name
        assert not inspect.iscoroutinefunction(executor.submit), name
        assert list(inspect.signature(executor.submit).parameters) == ["job"], name
        stop = inspect.signature(executor.stop).parameters
        assert list(stop) == ["timeout"] and stop["timeout"].default == 10.0, name
        # Health is one figure, the same for every kind.
        assert isinstance(executor.live, int) and isinstance(executor.restarts, int), name
        assert not hasattr(executor, "alive"), name


def test_the_protocol_refuses_what_lacks_the_health_figure() -> None:
    class NoHealth:
        on_live = None
        restarts = 0

        async def start(self) -> None: ...

        def submit(self, job: Any) -> None: ...

        async def stop(self, timeout: float = 10.0) -> None: ...

    assert not isinstance(NoHealth(), Executor)


def test_each_capability_is_declared_by_the_executors_that_have_it(tmp_path: Path) -> None:
    every = _executors(tmp_path)
    threads, processes, devices, step_thread, step_process, pinned, instance = every
    has = {
        Staging: [threads, pinned, instance],
        Inline: [threads, pinned, instance],
        RunAhead: [step_process],
        SequenceCheck: [step_process],
        ChildProcesses: [processes, devices, step_process],
        EngineHandle: [threads, processes, devices, step_thread, pinned, instance],
    }
    for capability, executors in has.items():
        for executor in every:
            found = isinstance(executor, capability)
            assert found == any(executor is e for e in executors), (
                f"{type(executor).__name__} {'has' if found else 'lacks'} {capability.__name__}"
            )
    assert step_process.pids == [] and processes.pids == [] and devices.pids == []
