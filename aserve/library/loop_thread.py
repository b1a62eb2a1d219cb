"""An asyncio event loop in a daemon thread, for a ``Batched`` whose callers have none.

Other threads reach it only through ``loop.call_soon_threadsafe`` and
``asyncio.run_coroutine_threadsafe``. Daemon, so that a function stuck in
native code cannot keep the interpreter from exiting.
"""

from __future__ import annotations

import asyncio
import logging
import threading

log = logging.getLogger("aserve.library")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and wait for its thread (blocking; never call it on the loop)."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            return  # already closed
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the loop thread %s did not stop within %.1fs", self._thread.name, timeout)
