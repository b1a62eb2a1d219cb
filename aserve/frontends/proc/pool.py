"""The core's side of ``http.workers``: its private socket and the frontend processes'
lives (frontends layer, on the loop).

:class:`BehindFrontends` binds the public address (:mod:`.listeners`), serves
the core's own aiohttp app on a Unix socket in a private folder, and keeps
``http.workers`` frontend processes (:mod:`.main`) running:

- **spawn**: ``python -m aserve.frontends.proc.main``, a fresh interpreter
  (never a fork of the core, which holds threads and maybe torch), handed the
  listening sockets and one end of a socket pair (its control channel) as
  inherited descriptors; it is up once it writes :data:`~.wire.READY_LINE`.
  A first start that fails fails the server's start.
- **restart**: a frontend that exits while the server is not stopping is
  started again at once; a start that fails is retried after
  :data:`~aserve.workers.supervisor.RESTART_BACKOFF_S`, as the model
  processes are. What it held is lost with it: its connections to the core
  close, so the core cancels its requests in flight (as it does for any
  client gone); the other frontends' connections are not touched.
- **drain**: :data:`~.wire.DRAIN_LINE` to each; a frontend stops accepting,
  answers what it holds and exits (:mod:`.frontend`); the core's app serves
  them until then.
- **stop**: what is still running after the drain is killed.

A frontend whose control channel reaches EOF (the core is gone, even killed)
exits at once, so none outlives its core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from aserve.frontends.proc.fast_core import CoreRings
from aserve.frontends.proc.listeners import bind_public, private_dir, remove_private_dir
from aserve.frontends.proc.wire import (
    CORE_SOCKET_NAME,
    COUNTS_PREFIX,
    DRAIN_LINE,
    KEYS_PREFIX,
    READY_LINE,
)
from aserve.workers.supervisor import RESTART_BACKOFF_S, restart_delay

if TYPE_CHECKING:
    from aserve.config import ServerConfig
    from aserve.frontends.context import FrontendContext

log = logging.getLogger("aserve.http")

MODULE = "aserve.frontends.proc.main"
# A frontend's start is an interpreter importing aiohttp and the frontend's modules.
READY_TIMEOUT_S = 60.0
# How long after its drain began a frontend gives up on what it still holds: the
# core's own drain_timeout_s, then the cut-off that follows it, then this.
DRAIN_MARGIN_S = 1.0
_KILL_WAIT_S = 5.0


class FrontendStartError(OSError):
    """A frontend process could not start: the message says how it ended."""


def frontend_settings(config: ServerConfig, base_dir: Path, cut_off_s: float) -> dict[str, Any]:
    """What a frontend process reads of the server's config (its spec file's JSON)."""
    limits = config.limits
    return {
        "http": config.http.model_dump(mode="json"),
        "tls": None if config.tls is None else config.tls.model_dump(mode="json"),
        "keys": config.auth is not None,  # the first control line brings them
        "base_dir": str(base_dir),
        "max_connections": limits.max_connections,
        "max_pending_connections": limits.max_pending_connections,
        "max_request_bytes": limits.max_request_bytes,
        # Each frontend's share of the bodies it may hold while they arrive.
        "inflight_share_bytes": limits.inflight_bytes_limit // config.http.workers,
        "drain_s": config.drain_timeout_s + cut_off_s + DRAIN_MARGIN_S,
        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    }


class _Frontend:
    """One frontend process slot: the process now in it, its control channel."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: asyncio.StreamWriter | None = None
        # Done when the process in the slot has exited: its end of the control
        # channel reached EOF (at once, however it ended: no child watcher involved).
        self.gone: asyncio.Future[None] | None = None
        self.keeper: asyncio.Task[None] | None = None  # restarts it while not stopping
        self.rings: CoreRings | None = None  # the fast path's, new for each start

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def tell_drain(self) -> None:
        control = self.control
        if control is not None and not control.is_closing():
            control.write(DRAIN_LINE)

    async def exit_status(self) -> int:
        """Reap the process once it has exited (a pidfd read by the loop: no thread,
        no child watcher, neither of which a busy server may get to in time)."""
        proc = self.proc
        assert proc is not None
        status = proc.poll()
        if status is not None:
            return status
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        pidfd = os.pidfd_open(proc.pid)
        try:

            def readable() -> None:
                loop.remove_reader(pidfd)
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(pidfd, readable)
            try:
                await exited
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)
        return proc.wait()  # exited: at once


class BehindFrontends:
    """The public sockets, the core's private socket and ``http.workers`` frontends."""

    def __init__(self, ctx: FrontendContext, cut_off_s: float = 2.0) -> None:
        config, base_dir = ctx.config, ctx.base_dir
        self._ctx = ctx
        self._count = config.http.workers
        self._host = config.http.host
        self._port = config.http.port
        self._settings = frontend_settings(config, base_dir, cut_off_s)
        self._sockets: list[socket.socket] = []
        self._dir: Path | None = None
        self._site: web.UnixSite | None = None
        self._frontends = [_Frontend(i) for i in range(self._count)]
        self._stopping = False
        self.restarts = 0  # frontends started again after one exited
        self._ring_requests_before = 0  # over the rings of frontends that have exited

    @property
    def pids(self) -> list[int]:
        return [f.pid for f in self._frontends if f.pid is not None]

    def snapshot(self) -> dict[str, int]:
        """What ``/metrics`` shows of the frontends (:mod:`aserve.obs.frontend_metrics`)."""
        live = [f for f in self._frontends if f.gone is not None and not f.gone.done()]
        now = sum(f.rings.served for f in self._frontends if f.rings is not None)
        return {
            "running": len(live),
            "restarts": self.restarts,
            "ring_requests": self._ring_requests_before + now,
        }

    async def start(self, runner: web.AppRunner) -> list[tuple[str, int]]:
        """Bind the public address, serve ``runner``'s app on the private socket and
        start every frontend; the addresses bound. An :class:`OSError` (a bind, a
        frontend that did not start) leaves nothing behind."""
        self._sockets = bind_public(self._host, self._port)
        try:
            self._dir = private_dir()
            path = self._dir / CORE_SOCKET_NAME
            self._settings["core_socket"] = str(path)
            (self._dir / "frontend.json").write_text(json.dumps(self._settings))
            self._site = web.UnixSite(runner, str(path))
            await self._site.start()
            await asyncio.gather(*(self._spawn(f) for f in self._frontends))
        except BaseException:
            self._stopping = True
            await self._kill_all()
            self._close_sockets()
            if self._dir is not None:
                remove_private_dir(self._dir)
            raise
        for f in self._frontends:
            f.keeper = asyncio.create_task(self._keep(f), name=f"http-frontend-{f.index}")
        return [s.getsockname()[:2] for s in self._sockets]

    async def _spawn(self, f: _Frontend) -> None:
        """Start frontend ``f`` and wait until it listens (:class:`FrontendStartError`
        when it exits or stays silent first)."""
        assert self._dir is not None
        ours, theirs = socket.socketpair()
        listen = [s.fileno() for s in self._sockets]
        rings = CoreRings(self._ctx, f.index, self._dir)
        ring_fds = rings.fds if rings is not None else []
        fds = [theirs.fileno(), *listen, *ring_fds]
        argv = [
            sys.executable, "-m", MODULE, str(self._dir / "frontend.json"), str(f.index),
            str(theirs.fileno()), ",".join(map(str, listen)), ",".join(map(str, ring_fds)) or "-",
        ]  # fmt: skip
        try:
            # A fresh interpreter, exec'd at once. On the loop, not a thread: CPython
            # spawns with vfork here (no preexec_fn), which costs the same however
            # large the core is, and the default executor may be busy (a restart
            # must not wait for it).
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=fds)  # noqa: ASYNC220
        except OSError:
            ours.close()
            if rings is not None:
                rings.stop()
            raise
        finally:
            theirs.close()  # its copy: EOF must reach the core when the frontend exits
        f.proc = proc
        if rings is not None:
            rings.start()
        f.rings = rings
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        f.control = writer
        keys = self._ctx.api_keys
        if keys is not None:  # the keys the core checks, for the fast path's check
            writer.write(KEYS_PREFIX + json.dumps(keys.by_role()).encode() + b"\n")
        try:
            line = await asyncio.wait_for(reader.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if line != READY_LINE:
            writer.close()
            if rings is not None:
                rings.stop()
                f.rings = None
            proc.kill()
            status = await f.exit_status()
            raise FrontendStartError(
                f"HTTP frontend process {f.index} (pid {proc.pid}) ended with status {status} "
                "before it was listening (its log above says why)"
            )
        f.gone = asyncio.ensure_future(self._read_control(reader))
        log.info("HTTP frontend process %d is up (pid %d)", f.index, proc.pid)
        if self._stopping:  # the drain began while it started
            f.tell_drain()

    async def _keep(self, f: _Frontend) -> None:
        """Restart frontend ``f`` each time it exits, until the server stops."""
        while True:
            assert f.gone is not None and f.proc is not None
            await f.gone
            if f.control is not None:
                f.control.close()
            if f.rings is not None:  # what it had in flight is cancelled, nobody else's
                self._ring_requests_before += f.rings.served
                f.rings.stop()
                f.rings = None
            if self._stopping:
                return
            status = await f.exit_status()
            log.warning(
                "HTTP frontend process %d (pid %d) exited with status %d; its connections "
                "are lost, its requests in flight cancelled; starting it again",
                f.index, f.proc.pid, status,
            )  # fmt: skip
            for attempt in range(len(RESTART_BACKOFF_S) * 1000):
                try:
                    await self._spawn(f)
                except OSError as exc:
                    delay = restart_delay(attempt)
                    log.warning("%s; trying again in %g s", exc, delay)
                    await asyncio.sleep(delay)
                    if self._stopping:
                        return
                else:
                    self.restarts += 1
                    break

    async def _read_control(self, reader: asyncio.StreamReader) -> None:
        """A frontend's lines until EOF (it has exited, its descriptors closed): its
        refusals, added to the server's (``/metrics``) as they grow."""
        rejected = self._ctx.metrics.requests.rejected
        seen: dict[str, int] = {}
        while line := await reader.readline():
            if not line.startswith(COUNTS_PREFIX):
                continue
            try:
                counts = json.loads(line[len(COUNTS_PREFIX) :])
            except ValueError:
                continue
            for reason, n in counts.items():
                if isinstance(n, int) and n > seen.get(reason, 0):
                    rejected[reason] = rejected.get(reason, 0) + n - seen.get(reason, 0)
                    seen[reason] = n

    def close_listeners(self) -> None:
        """The drain's start: every frontend stops accepting and answers what it
        holds; the core's copies of the public sockets close."""
        self._stopping = True
        for f in self._frontends:
            f.tell_drain()
        self._close_sockets()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every frontend has exited; False when ``timeout_s`` passed first."""
        waits = [f.gone for f in self._frontends if f.gone is not None and not f.gone.done()]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        return not pending

    async def stop(self, timeout_s: float) -> None:
        """Give what still runs ``timeout_s`` to exit, then kill it."""
        if not self._stopping:
            self.close_listeners()
        if not await self.drain(timeout_s):
            log.warning("HTTP frontend processes still running after the drain: killing them")
        await self._kill_all()
        for f in self._frontends:
            if f.keeper is not None:
                f.keeper.cancel()
            if f.rings is not None:
                f.rings.stop()
                f.rings = None
        await asyncio.gather(
            *(f.keeper for f in self._frontends if f.keeper is not None), return_exceptions=True
        )

    def remove(self) -> None:
        """The private folder, once the core's app has closed its socket."""
        if self._dir is not None:
            remove_private_dir(self._dir)
            self._dir = None

    async def _kill_all(self) -> None:
        for f in self._frontends:
            proc = f.proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                try:
                    await asyncio.wait_for(f.exit_status(), _KILL_WAIT_S)
                except TimeoutError:
                    log.warning("HTTP frontend process %d (pid %d) did not die", f.index, proc.pid)
            elif proc is not None:
                await f.exit_status()  # reaped: no zombie left

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close()
