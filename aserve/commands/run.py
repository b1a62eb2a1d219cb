"""Running a server on a validated config until it is told to stop (every command that serves)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from aserve import __version__
from aserve.config import ServerConfig
from aserve.loop.reload import ConfigSource

log = logging.getLogger("aserve")


def run_server(
    config: ServerConfig, base_dir: Path, source: ConfigSource | None, what: str | Path
) -> int:
    """Serve until SIGINT/SIGTERM; the exit status (1: it could not start)."""
    from aserve.loop.runtime import Server, StartupError

    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    log.info("aserve %s starting with %s", __version__, what)
    try:
        runner(Server(config, base_dir, source).run())
    except StartupError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
