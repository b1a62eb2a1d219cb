"""Small async helpers for talking to a test server with aiohttp."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp


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
