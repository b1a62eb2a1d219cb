"""A frontend process of ``http.workers``: ``python -m aserve.frontends.proc.main SPEC INDEX
CONTROL_FD LISTEN_FDS RING_FDS`` (frontends layer; the process's main thread runs its loop).

Started by the core (:mod:`.pool`), never by hand. ``SPEC`` is the JSON file
of what it reads of the config (:func:`.pool.frontend_settings`, the core's
socket among it); the descriptors are inherited: ``CONTROL_FD`` one end of
the core's control channel, ``LISTEN_FDS`` (comma-separated) the listening
sockets the core bound, ``RING_FDS`` the fast path's rings (the request ring's
memory, bell and room, then the answer ring's; ``-``: none, every request is
forwarded). It serves until told to drain (:data:`~.wire.DRAIN_LINE`, or SIGTERM:
a service manager that signals every process of the server at once must not
cost a request), and exits at once when the control channel reaches EOF (the
core is gone). SIGINT is ignored: a Ctrl-C in a terminal reaches the whole
process group, and the core drains the frontends itself.

It never imports torch or any engine: everything it does is HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from aserve.frontends.auth import ApiKeys
from aserve.frontends.proc.frontend import Frontend
from aserve.frontends.proc.listeners import remove_private_dir
from aserve.frontends.proc.rings import RingFds
from aserve.frontends.proc.wire import (
    COUNTS_INTERVAL_S,
    COUNTS_PREFIX,
    DRAIN_LINE,
    KEYS_PREFIX,
    READY_LINE,
)
from aserve.obs import logs

log = logging.getLogger("aserve.http.frontend")


async def serve(
    settings: dict[str, object], control_fd: int, listen_fds: list[int], ring_fds: list[int]
) -> int:
    """Serve until drained (0) or until the core is gone (1)."""
    loop = asyncio.get_running_loop()
    control = socket.socket(fileno=control_fd)
    reader, writer = await asyncio.open_unix_connection(sock=control)
    sockets = [socket.socket(fileno=fd) for fd in listen_fds]
    rings = None
    if ring_fds:
        rings = (RingFds(*ring_fds[:3]), RingFds(*ring_fds[3:6]))
    keys = None
    if settings["keys"]:
        line = await reader.readline()
        if not line.startswith(KEYS_PREFIX):
            log.error("no API keys from the core: this frontend process exits")
            return 1
        roles = json.loads(line[len(KEYS_PREFIX) :])
        keys = ApiKeys(roles["inference"], roles["admin"])
    frontend = Frontend(settings, sockets, rings, keys)
    await frontend.start()
    writer.write(READY_LINE)
    await writer.drain()
    drain = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, drain.set)

    async def read_control() -> bool:
        """True: told to drain; False: the core is gone."""
        while True:
            line = await reader.readline()
            if line == DRAIN_LINE:
                return True
            if not line:
                return False

    async def report_counts() -> None:
        """The refusals' counts to the core whenever they changed (at most once a second)."""
        sent: dict[str, int] = {}
        while True:
            await asyncio.sleep(COUNTS_INTERVAL_S)
            if frontend.rejected != sent and not writer.is_closing():
                sent = dict(frontend.rejected)
                writer.write(COUNTS_PREFIX + json.dumps(sent).encode() + b"\n")

    told = asyncio.ensure_future(read_control())
    signalled = asyncio.ensure_future(drain.wait())
    reporter = asyncio.ensure_future(report_counts())
    await asyncio.wait([told, signalled], return_when=asyncio.FIRST_COMPLETED)
    reporter.cancel()
    if told.done() and not told.result():
        log.warning("the core is gone: this frontend process (pid %d) exits", os.getpid())
        # A core that was killed left its private folder: the first frontend to see it
        # gone removes it (the folder is this server's alone).
        remove_private_dir(Path(settings["core_socket"]).parent)
        return 1
    signalled.cancel()
    await frontend.close_listeners()
    drain_s = settings["drain_s"]
    assert isinstance(drain_s, float | int)
    if not await frontend.drain(float(drain_s)):
        log.warning("frontend process %d: connections still open at its drain's end", os.getpid())
    await frontend.stop()
    told.cancel()
    writer.close()
    return 0


def main(argv: list[str]) -> int:
    spec, _index, control_fd, listen, rings = argv
    settings = json.loads(Path(spec).read_text())
    logs.configure(settings["log_level"], os.environ.get(logs.FORMAT_ENV, "text"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    listen_fds = [int(fd) for fd in listen.split(",")]
    ring_fds = [] if rings == "-" else [int(fd) for fd in rings.split(",")]
    return runner(serve(settings, int(control_fd), listen_fds, ring_fds))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
