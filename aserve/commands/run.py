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
    from aserve.commands.preflight import address_in_use

    # Before the imports below (torch among them): a port in use fails in milliseconds.
    busy = address_in_use(config)
    if busy is not None:
        print(f"aserve: error: {busy}", file=sys.stderr)
        return 1
    from aserve.server import Server, StartupError

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
