"""One change of what is served at a time, and what the change in progress is doing.

Layer: loop; everything here runs on the event loop. The reloader
(:mod:`aserve.loop.reload`) applies each change (a config file's new content,
a repository load or unload) while it holds :class:`ChangeSlot`; a load that
takes long must not hold everything behind it for good, so the slot decides
who waits:

- A config file's content supersedes the change in progress: that change is
  given up (cancelled: its new runtimes unload, the config in force stays,
  its status says why) and the new content is applied as soon as that
  cleanup is done. A file written while an older one still loads (a fix for a
  model whose load hangs) takes over at once; the newest file wins.
- A repository call waits for the change in progress at most
  :data:`REPOSITORY_WAIT_S`, then is refused (503) naming what is loading
  and for how long.

The runtimes being loaded, at startup or in a change, are listed here too
(:meth:`ChangeSlot.loading`), so that the repository index and
``GET /v2/config/status`` can say what each load is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aserve.errors import Unavailable
from aserve.loop.runtimes.base import Runtime

log = logging.getLogger("aserve.reload")

# How long a repository load or unload waits for another change in progress.
REPOSITORY_WAIT_S = 5.0


class ChangeGivenUp(Unavailable):
    """A change was given up before it was applied: a newer config file superseded
    it, or the server is stopping. Nothing of it applies; the config in force stays."""


@dataclass
class _Change:
    trigger: str
    digest: str | None  # the config file content it applies; None for the repository API
    task: asyncio.Task[Any]  # the task applying it, cancelled to give it up
    since: float  # time.monotonic() when it began
    given_up: str | None = None  # why it was given up, once it was


@dataclass(frozen=True)
class Loading:
    """A runtime being loaded: since when (``time.monotonic()``) and for how long at most."""

    runtime: Runtime
    since: float
    timeout_s: float

    def describe(self, now: float) -> str:
        return (
            f"{self.runtime.load_step}, for {now - self.since:.1f} s of its "
            f"load_timeout_s {self.timeout_s:g} s"
        )


class ChangeSlot:
    """The lock of changes, the change holding it, and the loads in progress.

    ``on_given_up(trigger, reason)`` records a change that was given up while
    it ran (the reloader's rejection: log and ``/v2/config/status``).
    """

    def __init__(self, lock: asyncio.Lock, on_given_up: Callable[[str, str], None]) -> None:
        self._lock = lock
        self._on_given_up = on_given_up
        self._change: _Change | None = None
        self._wanted: str | None = None  # the newest config content asked for
        self._loading: dict[tuple[str, str], Loading] = {}

    def applying(self, digest: str) -> bool:
        """Whether that config content is the change in progress."""
        return self._change is not None and self._change.digest == digest

    def settle_on(self, digest: str, trigger: str) -> None:
        """The config file holds ``digest``, the content in force, again: a change
        to other content, in progress or waiting, no longer applies."""
        self._wanted = digest
        change = self._change
        if change is not None and change.digest is not None and change.digest != digest:
            self.give_up(f"the config file went back to the config in force ({trigger})")

    @contextlib.asynccontextmanager
    async def hold(self, trigger: str, digest: str | None = None) -> AsyncIterator[None]:
        """Hold the slot for one change (``digest``: the config content it applies).

        Raises :class:`ChangeGivenUp` when the change is given up, before it
        began (a newer content came while it waited) or while it ran (the
        body's awaits are cancelled, and what it loaded is unloaded by it);
        :class:`Unavailable` when a repository call waited too long.
        """
        if digest is not None:
            self._wanted = digest
            self.give_up(f"superseded by a newer config ({trigger})")
            await self._lock.acquire()
            if self._wanted != digest:
                self._lock.release()
                raise ChangeGivenUp(f"{trigger}: superseded by a newer config before it began")
        else:
            try:
                await asyncio.wait_for(self._lock.acquire(), REPOSITORY_WAIT_S)
            except asyncio.TimeoutError:
                raise Unavailable(
                    f"{trigger}: another change is being applied ({self.progress()}); "
                    "try again once it is done (GET /v2/config/status)"
                ) from None
        task = asyncio.current_task()
        assert task is not None
        change = _Change(trigger, digest, task, time.monotonic())
        self._change = change
        try:
            yield
        except asyncio.CancelledError:
            if change.given_up is None:  # not ours: whoever cancelled it gets it
                raise
            # Ours: the cancellation ends here, as asyncio.timeout's does.
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
            self._on_given_up(trigger, f"given up: {change.given_up}")
            raise ChangeGivenUp(f"{trigger} was given up: {change.given_up}") from None
        finally:
            self._change = None
            self._lock.release()

    def give_up(self, reason: str) -> None:
        """Give up the change in progress, if there is one, saying ``reason``."""
        change = self._change
        if change is None or change.given_up is not None:
            return
        log.warning("giving up the change in progress (%s): %s", self._describe(change), reason)
        change.given_up = reason
        change.task.cancel()

    # --- what is loading ----------------------------------------------------------

    @contextlib.contextmanager
    def loading(self, runtimes: Sequence[Runtime], timeouts_s: Sequence[float]) -> Iterator[None]:
        """List ``runtimes`` as loading (each with its load timeout) for the block."""
        now = time.monotonic()
        entries = {
            (rt.name, rt.version): Loading(rt, now, t)
            for rt, t in zip(runtimes, timeouts_s, strict=True)
        }
        self._loading.update(entries)
        try:
            yield
        finally:
            for key, entry in entries.items():
                if self._loading.get(key) is entry:
                    del self._loading[key]

    def loading_of(self, key: tuple[str, str]) -> Loading | None:
        return self._loading.get(key)

    def progress(self) -> str:
        """The change in progress and its loads, in words ("nothing" if none)."""
        change = self._change
        return "nothing" if change is None else self._describe(change)

    def progress_doc(self) -> dict[str, Any] | None:
        """The change in progress for ``GET /v2/config/status`` (None if none)."""
        change = self._change
        if change is None:
            return None
        now = time.monotonic()
        return {
            "trigger": change.trigger,
            "for_s": round(now - change.since, 3),
            "loading": [
                {
                    "name": e.runtime.name,
                    "version": e.runtime.version,
                    "step": e.runtime.load_step,
                    "for_s": round(now - e.since, 3),
                    "load_timeout_s": e.timeout_s,
                }
                for e in self._loading.values()
            ],
        }

    def _describe(self, change: _Change) -> str:
        now = time.monotonic()
        loads = [f"model '{e.runtime.label}': {e.describe(now)}" for e in self._loading.values()]
        what = f"{change.trigger}, for {now - change.since:.1f} s"
        return f"{what}; loading {'; '.join(loads)}" if loads else what
