"""An aserve server in the test's own process and event loop.

For tests that need the real frontends, batcher and engines but not a
separate process: no interpreter start, no torch import, no log polling, so
such a test costs milliseconds, and a profile hook can follow one request
through the code. Tests that send signals, kill workers or read the log keep
using ``conftest.start_server``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config import parse_config
from aserve.server import Server


@dataclass
class InProcessServer:
    server: Server
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def in_process(config: dict[str, Any], base_dir: Path) -> AsyncIterator[InProcessServer]:
    """Start a server on ``config`` (HTTP on a free loopback port; relative model
    paths resolve against ``base_dir``), ready when the block starts; stopped after."""
    http = {**config.get("http", {}), "host": "127.0.0.1", "port": 0}
    config = {"drain_grace_s": 0, **config, "http": http}
    server = Server(parse_config(json.loads(json.dumps(config))), base_dir)
    await server.start()
    try:
        yield InProcessServer(server, server.http.addresses[0][1])
    finally:
        await server.stop()
