"""One supervisor for the server's child processes, on the loop.

Layer: ``workers``, loop side. A worker process of a batched model
(:mod:`.batch_process`, one :class:`Supervisor` per instance) and a decoder
model's step process (:mod:`.step_process`) live the same life, kept here:

- **spawn** (``spawn``, not ``fork``: the server has threads a fork would
  copy half of) with the server's end of the pipe taken over by the loop
  (:mod:`.pipe`);
- **handshake**: the child says ``("ready", ...)`` or ``("load_error",
  text)``; a first start that fails raises the owner's error type with that
  text, or with how the child exited if it died first;
- **restart**: once up, a child that exits (its pipe reaches EOF) is
  ``up = False`` at once (``on_live``), reaped, its work in flight handed
  back to the owner with the reason (``on_lost``, exit code and the child's
  last ``("fatal", text)`` included), and started again; a start that fails
  is retried after :data:`RESTART_BACKOFF_S` (0.5 s, then longer, up to
  10 s). When it is up ``on_live`` is called again;
- **stop**: cut a restart short (what was lost is still handed back), tell
  the child to stop, wait for it (killed after ``timeout``), and read what
  it wrote before it exited.

A child may also be started before its supervisor exists
(:func:`start_early`, from the command line before the server's own
imports): the first spawn of a supervisor with the same process name,
target and arguments takes that child over instead of starting one, and
:func:`stop_early` stops the ones nobody took.

After the handshake the supervisor is off the path of the jobs: the
channel hands every message (the ``ready`` one first) to the owner's
``on_message`` as it came (msgpack bytes, in order), and the owner writes
to :attr:`Supervisor.channel` itself. A ``("fatal", text)`` that comes then
is the owner's to record in :attr:`Supervisor.fatal`. What runs in the
child is :mod:`.child`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from aserve.workers.pipe import PipeChannel

log = logging.getLogger("aserve.executor")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
_MAX_ATTEMPTS = 10_000  # ~28 hours at the longest delay: then it stays down


def start(
    target: Callable[..., None], args: tuple[Any, ...], name: str
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """Start ``target(child_conn, *args)`` in a new process; its process and the server's end."""
    # spawn, not fork: the server has threads (gRPC, torch) a fork would copy half of.
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()  # the parent's copy: EOF must reach the server when the child exits
    return proc, parent


# Children started before their supervisor (start_early), by process name, with
# the target and arguments they were started with.
_early: dict[
    str,
    tuple[Callable[..., None], tuple[Any, ...], multiprocessing.process.BaseProcess, Connection],
] = {}


def start_early(target: Callable[..., None], args: tuple[Any, ...], name: str) -> int | None:
    """Start ``target(child_conn, *args)`` now, for the first :class:`Supervisor` of
    process ``name`` to take over; the child's pid (None: one was started already).

    A cold start's longest part is the child's own (a second interpreter
    importing torch and loading the weights): started before the server
    imports its frontends, it runs beside them rather than after. Only one
    child is started per name: two versions of one model share their process
    names, and a spawn with other arguments stops the early child and starts
    its own.
    """
    if name in _early:
        return None
    proc, parent = start(target, args, name)
    _early[name] = (target, args, proc, parent)
    return proc.pid


def stop_early() -> None:
    """Stop every child started early that no supervisor took (blocking: off the loop)."""
    while _early:
        _, (_, _, proc, parent) = _early.popitem()
        _stop_unused(proc, parent)


def _stop_unused(proc: multiprocessing.process.BaseProcess, parent: Connection) -> None:
    """Kill and reap a child started early that nobody took (blocking)."""
    parent.close()
    proc.kill()
    proc.join(5.0)


def reap(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait for ``proc`` to exit (blocking: call off the loop); kill it after ``timeout``."""
    proc.join(timeout)
    if proc.is_alive():
        if timeout > 0:
            log.warning(
                "child process %s did not stop within %.1fs; killing it", proc.name, timeout
            )
        proc.kill()
        proc.join(5.0)


def _reap_after(exc: BaseException) -> float:
    """How long a child whose start failed gets to exit by itself: none when the
    start was cancelled (its model's load was given up: a child stuck loading
    reads no pipe, so only a kill ends it)."""
    return 0.0 if isinstance(exc, asyncio.CancelledError) else 5.0


def restart_delay(attempt: int, backoff: Sequence[float] = RESTART_BACKOFF_S) -> float:
    """Seconds to wait after the ``attempt``-th failed restart (0-based)."""
    return backoff[min(attempt, len(backoff) - 1)]


class Supervisor:
    """One child process, kept running for its owner (every method on the loop).

    ``title`` names the child in logs and errors ("worker process 0 of 'm'").
    ``error`` is the owner's exception type for a failed start. ``sleep`` is
    what waits between failed restarts (a test passes one that records).
    """

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        title: str,
        proc_name: str,
        error: type[Exception],
        on_message: Callable[[bytes], None],
        on_lost: Callable[[str], None],
        on_live: Callable[[], None],
        backoff: Sequence[float] = RESTART_BACKOFF_S,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.title = title
        self._target = target
        self._args = args
        self._proc_name = proc_name
        self._error = error
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_live = on_live
        self._backoff = backoff
        self._sleep = sleep
        self._proc: multiprocessing.process.BaseProcess | None = None
        # The pipe to the child now; the owner sends its jobs here while ``up``.
        self.channel: PipeChannel | None = None
        self._ready: asyncio.Future[None] | None = None  # while a start awaits the handshake
        self.fatal = ""  # what the child said killed it, if it could
        self._lost = False  # it died up, and on_lost has not been told yet
        self._restart: asyncio.Task[None] | None = None
        self._stopping = False
        self.up = False
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        """The child's process id while one is up."""
        return self._proc.pid if self.up and self._proc is not None else None

    async def start(self) -> None:
        """Start the child; returns once it has loaded (or raises why not: no restart)."""
        await self._spawn()

    async def stop(self, timeout: float = 10.0) -> None:
        """Let the child finish its job (answered as usual, through ``on_message``) and exit."""
        self._stopping = True
        task = self._restart
        if task is not None:
            task.cancel()
            # A replacement being started reaps what it started before it ends.
            await asyncio.gather(task, return_exceptions=True)
        self._tell_lost()  # died, and its restart was cut short before it was reaped
        proc, channel = self._proc, self.channel
        if channel is not None:
            try:
                channel.send(msgpack.packb(("stop",)))
            except OSError:
                pass
        if proc is not None:
            await asyncio.to_thread(reap, proc, timeout)
        if channel is not None:
            # The channel stays open until the child's end closes, so that the
            # answer to its last job, written before it exited, is read.
            try:
                await asyncio.wait_for(channel.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
        self._drop()

    def exit_reason(self) -> str:
        """How the child ended, for logs and the errors of what it had in flight."""
        code = self._proc.exitcode if self._proc is not None else None
        return (
            f"the {self.title} exited"
            + (f" (exit code {code})" if code is not None else "")
            + (f": {self.fatal}" if self.fatal else "")
        )

    # --- the child's life ----------------------------------------------------------

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        early = await self._take_early()
        proc, parent = early or start(self._target, self._args, self._proc_name)
        self._proc, self.fatal = proc, ""
        self._ready = ready = loop.create_future()
        # The channel is ours before it is connected: its first message (the
        # handshake) may be read before connect() returns, and the handshake hands
        # the stream on to the owner through self.channel. Set after the await, it
        # was still None then when the loop had been held while the child loaded
        # (another model's import on the loop): the owner's messages kept coming
        # here and were dropped, and their batches never answered.
        self.channel = channel = PipeChannel(self._on_payload, self._on_closed)
        try:
            try:
                await channel.connect(parent)
            except BaseException as exc:
                self.channel = None
                parent.close()
                await asyncio.to_thread(reap, proc, _reap_after(exc))  # it exits on EOF
                raise
            try:
                await ready
            except BaseException as exc:
                self._drop()
                await asyncio.to_thread(reap, proc, _reap_after(exc))
                raise
        finally:
            self._ready = None
        if self._stopping:
            self._drop()
            await asyncio.to_thread(reap, proc, 5.0)
            return
        self.up = True
        # The pid in the log lets an operator (and a test) find, signal or profile one child.
        log.info("%s is up (pid %d%s)", self.title, proc.pid, ", started early" if early else "")

    async def _take_early(
        self,
    ) -> tuple[multiprocessing.process.BaseProcess, Connection] | None:
        """The child started early under this one's process name, if it was started
        as this one would start it; one started otherwise is stopped."""
        entry = _early.pop(self._proc_name, None)
        if entry is None:
            return None
        target, args, proc, parent = entry
        if target is self._target and args == self._args:
            return proc, parent
        log.warning("the %s started early was started otherwise: starting it again", self.title)
        await asyncio.to_thread(_stop_unused, proc, parent)
        return None

    def _on_payload(self, payload: bytes) -> None:
        """A message during the handshake (after it, they go to the owner directly)."""
        msg = msgpack.unpackb(payload, use_list=True)
        kind = msg[0]
        if kind == "fatal":
            self.fatal = msg[1]
            return
        ready = self._ready
        if kind == "load_error":
            if ready is not None and not ready.done():
                ready.set_exception(self._error(msg[1]))
            return
        if kind != "ready":
            log.error("the %s sent %r before it was ready", self.title, kind)
            return
        if ready is not None and not ready.done():
            ready.set_result(None)
        if self.channel is not None:
            self.channel.on_message = self._on_message
        self._on_message(payload)

    def _on_closed(self) -> None:
        self._drop()
        ready = self._ready
        if ready is not None:  # died while loading: _spawn raises
            if not ready.done():
                ready.set_exception(self._error(self.exit_reason()))
            return
        if self._stopping:
            return
        self._lost = True
        self._on_live()
        self._restart = asyncio.ensure_future(self._restart_child())

    def _tell_lost(self) -> None:
        if self._lost:
            self._lost = False
            self._on_lost(self.exit_reason())

    def _drop(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        self.up = False

    async def _restart_child(self) -> None:
        if self._proc is not None:
            # Reaped first, so that the error of its job in flight can say how it ended.
            await asyncio.to_thread(reap, self._proc, 5.0)
        log.error("%s; restarting it", self.exit_reason())
        self._tell_lost()
        for attempt in range(_MAX_ATTEMPTS):
            if self._stopping:
                return
            try:
                await self._spawn()
            except Exception as exc:
                log.error("restarting the %s failed: %s", self.title, exc)
                await self._sleep(restart_delay(attempt, self._backoff))
                continue
            if self._stopping:
                return
            self.restarts += 1
            self._restart = None
            log.warning("%s is back (restart %d)", self.title, self.restarts)
            self._on_live()
            return
