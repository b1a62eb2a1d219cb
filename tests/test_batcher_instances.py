"""The batcher with fewer live instances than configured (one is being restarted):
batches go only to live ones, and admission predicts with the live count."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from aserve.config import BatchingConfig
from aserve.errors import Unavailable
from aserve.loop.batcher import Batcher
from aserve.loop.request import InferenceRequest
from aserve.obs.stats import ModelStats
from aserve.workers.job import BatchJob

pytestmark = pytest.mark.timeout(30)

BATCH_S = 1.0  # every batch size "takes" a second: the predictions below are whole seconds


class _Instances:
    """A pool as the batcher sees it: ``live`` of ``instances`` can take a batch,
    and batches stay out until the test answers them."""

    def __init__(self, instances: int) -> None:
        self.instances = instances
        self.live = instances
        self.on_live: Any = None
        self.jobs: list[BatchJob] = []

    def submit(self, job: BatchJob) -> None:
        self.jobs.append(job)

    def set_live(self, live: int) -> None:
        """What a pool does when an instance dies or comes back."""
        self.live = live
        if self.on_live is not None:
            self.on_live()


def _request(deadline_in: float) -> InferenceRequest:
    now = time.monotonic()
    loop = asyncio.get_running_loop()
    return InferenceRequest({"X": np.zeros((1, 1), np.float32)}, 1, (), now,
                            now + deadline_in, loop.create_future(), None, None)  # fmt: skip


async def _passes() -> None:
    for _ in range(3):  # the batcher pumps with call_soon
        await asyncio.sleep(0)


async def test_batches_and_admission_count_only_live_instances() -> None:
    pool = _Instances(2)
    batcher = Batcher(
        "m/1", BatchingConfig(max_batch_size=4, max_delay_ms=0), pool, ModelStats("m", "1")
    )
    for size in range(1, 5):
        batcher.latency.observe(size, BATCH_S)
    try:
        for _ in range(2):  # one batch each
            batcher.submit(_request(60.0))
            await _passes()
        assert len(pool.jobs) == 2  # both instances busy
        for _ in range(8):
            batcher.submit(_request(60.0))
        await _passes()
        assert len(pool.jobs) == 2 and batcher.pending == 8

        # 8 ahead in batches of 4 after the first free instance (1 s): with two
        # instances the new request ends at 3 s, with one at 4 s.
        now = time.monotonic()
        batcher.check_admission(now, now + 3.5 * BATCH_S, 1)

        pool.set_live(1)  # an instance died; the batch it ran fails
        dead = pool.jobs[0]
        dead.error = RuntimeError("the worker process exited")
        dead.on_done(dead)
        await _passes()
        assert len(pool.jobs) == 2, "a batch went to the dead instance's slot"
        now = time.monotonic()
        with pytest.raises(Unavailable, match="cannot meet the request's deadline"):
            batcher.check_admission(now, now + 3.5 * BATCH_S, 1)
        batcher.check_admission(now, now + 4.5 * BATCH_S, 1)

        pool.set_live(2)  # the replacement is up: a batch runs on it at once
        await _passes()
        assert len(pool.jobs) == 3 and batcher.pending == 4
    finally:
        batcher.close()
