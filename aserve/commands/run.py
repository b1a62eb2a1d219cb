"""Running a server on a validated config until it is told to stop (every command that serves)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from aserve import __version__
from aserve.config import ServerConfig
from aserve.engines import builtin
from aserve.loop.reload import ConfigSource
from aserve.workers import batch_process, last_resort, offload

log = logging.getLogger("aserve")


def run_server(
    config: ServerConfig, base_dir: Path, source: ConfigSource | None, what: str | Path
) -> int:
    """Serve until SIGINT/SIGTERM; the exit status (1: it could not start).

    A process that still has threads it could not stop (a load or a batch
    stuck in a model) does not return: it ends with ``os._exit(1)`` here, as
    an interpreter that finalises under them would hang or abort.
    """
    from aserve.commands.preflight import address_in_use

    # Before the imports below (torch among them): a port in use fails in milliseconds.
    busy = address_in_use(config)
    if busy is not None:
        print(f"aserve: error: {busy}", file=sys.stderr)
        return 1
    start_workers_early(config, base_dir)
    from aserve.server import Server, StartupError

    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    log.info("aserve %s starting with %s", __version__, what)
    status = 0
    try:
        runner(Server(config, base_dir, source).run())
    except StartupError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        pass
    left = offload.left_behind()
    if left:
        last_resort.exit_now(
            f"stopped, but {len(left)} thread(s) could not be stopped and are still running "
            f"(a thread cannot be interrupted): {'; '.join(left)}"
        )
    return status


def start_workers_early(config: ServerConfig, base_dir: Path) -> None:
    """Start the worker processes of the models served with ``"executor": "process"``
    now, before the server's own imports (a third of a second or more).

    A worker's start (an interpreter importing torch and the handler's
    libraries, then the weights) is the longest part of such a model's cold
    start; the server takes these children over when it loads the model (see
    :func:`aserve.workers.supervisor.start_early`), so they overlap its
    imports. Which models, and with what, is the runtime's choice again at
    load time: a child started for anything else is stopped and replaced, so
    a guess here can cost time but not change what runs. A builtin model is
    built on first use by its runtime and so starts as usual, and so does
    every model after a spawn that fails here.
    """
    for model in config.models:
        if model.executor != "process":
            continue
        if model.path is not None and model.path.startswith(builtin.PREFIX):
            continue
        folder = model.folder(base_dir)
        path = None if model.path is None else builtin.locate(model.path, folder)
        spec = batch_process.worker_spec(model, path, folder, config.gpu)
        try:
            batch_process.start_early(spec, model.instances, model.name)
        except OSError as exc:  # no process to spare now: the model's own start tries again
            log.warning("could not start the workers of '%s' early: %s", model.name, exc)
            return
