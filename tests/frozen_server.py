"""``python -m aserve`` whose event loop freezes once the server is ready: for tests
of what signals still do then. Not collected by pytest.

The freeze is a call that never returns on the loop's own thread, in C code that
lets the GIL go (``time.sleep``), as a model's ``forward`` does when a tiny CPU
batch of it runs inline on the loop and never ends. ``frozen`` on stderr says
it has begun.

    python tests/frozen_server.py --config CONFIG --port 0
"""

from __future__ import annotations

import asyncio
import sys
import time

import aserve.server
from aserve.cli import main

_start = aserve.server.Server.start


def _freeze() -> None:
    print("frozen", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)  # a signal's Python handler runs in between; the loop never again


async def _start_then_freeze(self: aserve.server.Server) -> None:
    await _start(self)
    asyncio.get_running_loop().call_soon(_freeze)


aserve.server.Server.start = _start_then_freeze  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
