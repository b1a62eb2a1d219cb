"""A request body that trickles in is bounded by ``http.body_timeout_s``.

Its head is complete, so the header timeout no longer applies, and reading it
holds a ``limits.max_concurrency`` slot: without a bound, a few clients that
never finish their bodies keep every other request out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
from conftest import model_entry, spec
from inprocess import in_process

BODY = orjson.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]}
)


async def test_a_body_that_never_ends_is_answered_408_and_frees_its_slot(model_dir: Path) -> None:
    entry = model_entry(
        "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])]
    )
    config = {
        "http": {"body_timeout_s": 0.5},
        "limits": {"max_concurrency": 1},
        "models": [entry],
    }
    async with in_process(config, model_dir) as srv, aiohttp.ClientSession() as session:
        url = f"{srv.base}/v2/models/affine/infer"
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        head = (
            f"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        )
        writer.write(head.encode() + BODY[:10])  # and nothing more
        await writer.drain()
        # The server answers by itself; the wait is a watchdog, not a measure.
        status_line = await asyncio.wait_for(reader.readline(), timeout=30)
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout=30)) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = orjson.loads(await reader.readexactly(int(headers["content-length"])))
        writer.close()
        assert status_line.split()[1] == b"408", status_line
        assert "http.body_timeout_s (0.5 s)" in body["error"]
        # Closed after the answer (aiohttp reads what is still coming for a
        # moment first, so that the answer is not lost to a reset).
        assert headers["connection"] == "close"
        # The slot the slow body held is free again.
        async with session.post(url, data=BODY) as r:
            assert r.status == 200, await r.text()
