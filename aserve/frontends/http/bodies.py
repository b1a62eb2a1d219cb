"""Request bodies: how many bytes the HTTP frontend holds at once, and where (on the loop).

Every route reads its body here (V2 ``/infer``, Triton's generate, the
OpenAI routes, ``/predictions``, the admin routes), through
:func:`read_spooled`.

**How much: ``limits.max_inflight_bytes``** (:class:`BodyBudget`). A body
counts the bytes of it that have arrived, chunk by chunk as they arrive,
and what it inflated to (gzip, deflate), from its first chunk until its
request's handler task ends, once its answer is sent. What a Content-Length
declares costs nothing: a connection that declares 64 MiB and sends nothing
holds nothing, so a few of them cannot take the budget from requests that
send their bytes. (Declared lengths were charged before a byte arrived at
first: four sockets that each declared 64 MiB and sent nothing then held
the whole 256 MiB for ``http.body_timeout_s``, and every honest big body
was refused.) A declared length over ``max_request_bytes`` is still refused
before the body is read (413), by the route, at no cost to the budget. A
chunk that would take the total over the limit is refused at once,
wherever in its body it comes: :class:`~aserve.errors.QueueFull`, HTTP 429
with ``Retry-After``, as ``limits.max_concurrency`` refuses, naming the
limit, and counted under ``aserve_rejected_requests{reason="max_inflight_bytes"}``;
what of that body had arrived is dropped then, and stops counting then, so
that the other bodies go on. What is left of it is read and dropped after
the answer (aiohttp's lingering close, 10 s at most), so that the client,
still sending, reads its answer rather than a reset connection; none of it
is held. Refused rather than parked: a client can retry elsewhere, and a
parked body would hold its connection and the bytes it sent already. The
limit is at least
``max_request_bytes``, so one body of the largest size fits when nothing
else is held. A body that has all arrived with its request's head is not
counted (the app reads it without coming here): it is in memory already,
and small: aiohttp stops reading a connection once 128 KiB is buffered, so
such a body is a few hundred KiB at most. Without the bound, clients that
send big bodies at once made the server hold all of them (8 bodies of 60 MB
to ``/predictions`` took 1.2 GB), however few ``max_concurrency`` allows,
which is off by default.

What the bound leaves: a client that sends real bytes holds them, for
``http.body_timeout_s`` at most (the whole body's time, not an idle time;
408 then, and released), so keeping the budget full takes sending it again
and again: at the defaults 256 MiB every 60 s, about 4.5 MB/s, from at
least four connections (one body is at most ``max_request_bytes``). That
is what an honest upload of that rate costs too; what is held lies mostly
in the spool files (below), not in memory. Bodies that arrive at once
compete for the budget by arrival, not by who came first: when they pass
it together, the one whose chunk comes then is refused, and the others go
on with its bytes freed (eight 60 MB bodies at once: four served, four
refused, as many as when declared lengths were charged).

**Where: a temporary file, over :data:`SPOOL_OVER_BYTES`.** A body held in
memory is held twice at its end (its pieces and their join) and copied by
calls that keep the GIL: joining 60 MB takes about 30 ms, in which the
event loop's thread cannot run, whichever thread does it; and its pieces, a
few hundred KiB each, are what glibc kept in its heaps afterwards. So a
bigger body goes to an unnamed temporary file instead
(``tempfile.TemporaryFile``: in ``$TMPDIR``, opened with ``O_TMPFILE`` where
Linux has it, so it has no name and nothing is left behind by a process
that dies), :data:`WRITE_BYTES` at a time on a thread (``os.writev`` lets go
of the GIL), and is read back on a thread by ``os.pread`` (which lets go of
it too): whole (:func:`read_back`: V2 infer, OpenAI, a raw ``/predictions``
body), or, for a ``/predictions`` multipart body, each part's data straight
into its own ``bytes`` (:mod:`aserve.frontends.http.multipart`). What the
server holds in memory then is about what the handler gets, once. The file
is closed, and so gone, as soon as the body has been read back, before the
handler runs; if the request fails first, when it fails. Where no temporary
file can be made (a read-only ``$TMPDIR``), big bodies are held in memory,
logged; a disk that refuses a write (full) fails the request with 503.

A request cancelled while a thread writes its body (the client went, the
body timed out) goes at once, but its file is closed only by the last
thread using it (:class:`SpooledBody`): closing it under the writing thread
freed its descriptor number, which the next file or socket the process
opened took, and the rest of the body landed there.

No ``malloc_trim`` after big bodies: measured with ``bench/multipart_memory.py``,
the server's RSS after eight 60 MB bodies comes back to where it started
without it (what stayed before was aiohttp's multipart reader's 16 KiB
pieces, kept in glibc's heaps).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO

from aiohttp import web

from aserve.errors import QueueFull, TooLarge, Unavailable
from aserve.obs.log_throttle import Throttled

HELD_KEY = web.RequestKey("aserve_body_bytes_held", int)


class BodyBudget:
    """The bytes of request bodies held at once, server-wide; see the module docstring.

    Loop only: a check and its update have no await between them, so the
    total is exact.
    """

    def __init__(self, limit: int, rejected: dict[str, int]) -> None:
        self.limit = limit
        self.held = 0
        self._rejected = rejected

    def hold(self, request: web.Request, total: int) -> None:
        """Count ``total`` bytes for ``request``'s body (when more than it counts
        already): bytes that arrived or that it inflated to, never a declared length.

        Raises :class:`QueueFull` when that would take the total over the limit,
        and lets go of what ``request`` held at once: its body is dropped as the
        error unwinds, with no await on the way, so the bodies still arriving
        can use the room before the refusal is answered. (Counted until the
        answer was sent, bodies that passed the limit together were
        refused, one chunk after another, while the first refusal was being
        answered: of eight bodies of 60 MB sent at once, none or two were
        served.)
        """
        had = request.get(HELD_KEY, 0)
        extra = total - had
        if extra <= 0:
            return
        if self.held + extra > self.limit:
            self._rejected["max_inflight_bytes"] = self._rejected.get("max_inflight_bytes", 0) + 1
            self.held -= had
            request[HELD_KEY] = 0
            raise QueueFull(
                f"request body: {total} bytes of it so far, and the server holds "
                f"{self.held} bytes of other request bodies; its limit "
                f"limits.max_inflight_bytes is {self.limit}; retry later"
            )
        if not had:
            # The handler's own task (aiohttp runs each in one): done once its
            # answer is sent, whether it returned, raised or was cancelled.
            task = asyncio.current_task()
            assert task is not None
            task.add_done_callback(functools.partial(self._release, request))
        request[HELD_KEY] = total
        self.held += extra

    def _release(self, request: web.Request, _task: object) -> None:
        self.held -= request.get(HELD_KEY, 0)
        request[HELD_KEY] = 0


async def body_chunks(request: web.Request, budget: BodyBudget, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, each counted in ``budget`` and against
    ``limit`` (``max_request_bytes``) before it is handed on.

    A declared length over ``limit`` is refused before a byte is read; one
    within it is not counted in ``budget``: only what arrives is (see the
    module docstring). Read chunk by chunk rather than with
    ``request.read()``, which holds a growing bytearray and a copy of it, and
    keeps the copy on the request for as long as the request lives.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise TooLarge(
            f"request body is {declared} bytes, over the limit max_request_bytes {limit}"
        )
    stream = request.content
    size = 0
    while chunk := await stream.readany():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body is over the limit max_request_bytes {limit}")
        budget.hold(request, size)
        yield chunk


# --- where: a temporary file -----------------------------------------------------

SPOOL_OVER_BYTES = 1 << 20  # a body over this goes to a file
WRITE_BYTES = 1 << 20  # written this much at a time
_IOV_MAX = 512  # pieces per writev (Linux takes 1024)

_no_file_log = Throttled(logging.getLogger("aserve.http"), logging.WARNING)


class SpooledBody:
    """A request body in an unnamed temporary file: written (:meth:`append`) and
    :meth:`read` on threads, then closed (:meth:`close`, or used as a context
    manager), after which it is gone.

    The file is closed only once no thread is inside a read or a write:
    :meth:`close` marks it closed at once, from any side and without waiting
    (a read or write that starts later finds it closed), and closes it then
    if no thread uses it, else the last thread out closes it. A thread that
    outlived its request (a write under a request the client cancelled, a
    handler thread past a deadline) so never writes to or reads from a
    descriptor number the process has given to another file meanwhile; and
    the loop never waits for a disk to close one. The lock is held only to
    count users, never across I/O.
    """

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self.size = size
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False

    @contextlib.contextmanager
    def _fd(self) -> Iterator[int]:
        """The file's descriptor, open until the block ends whoever closes it meanwhile."""
        with self._lock:
            if self._closing:
                raise ValueError("the spooled request body is closed")
            self._users += 1
        try:
            yield self._file.fileno()
        finally:
            with self._lock:
                self._users -= 1
                last = self._closing and not self._users
            if last:
                self._file.close()

    def read(self, start: int, stop: int) -> bytes:
        """On a thread: bytes ``start`` to ``stop`` (clipped to the body), by ``pread``."""
        stop = min(stop, self.size)
        if stop <= start:
            return b""
        with self._fd() as fd:
            data = os.pread(fd, stop - start, start)
            while len(data) < stop - start:  # a short read: rare for a regular file
                more = os.pread(fd, stop - start - len(data), start + len(data))
                if not more:
                    raise OSError(f"spooled request body ends at {start + len(data)}")
                data += more
            return data

    def append(self, pieces: list[bytes]) -> None:
        """On a thread: every piece, in order, at the file's end (``size`` grows by
        them); :class:`Unavailable` (503) when the disk refuses (full, say).

        Stops between two writes once the body is closed: its request is gone.
        """
        try:
            with self._fd() as fd:
                # Read without the lock: a stale False costs one more write, to
                # this file, which stays open until this block ends.
                while pieces and not self._closing:
                    written = os.writev(fd, pieces[:_IOV_MAX])
                    self.size += written
                    # A short write: drop what went, go on with the rest.
                    while pieces and written >= len(pieces[0]):
                        written -= len(pieces[0])
                        pieces = pieces[1:]
                    if written:
                        pieces[0] = pieces[0][written:]
        except OSError as exc:
            raise Unavailable(
                f"request body: cannot write it to a temporary file in {tempfile.gettempdir()} "
                f"({exc.strerror or exc}); retry later"
            ) from None

    def close(self) -> None:
        """Any side, never waiting: closed now, or by the last thread using it."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = not self._users
        if now:
            self._file.close()

    def __enter__(self) -> SpooledBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def read_spooled(request: web.Request, budget: BodyBudget, limit: int) -> bytes | SpooledBody:
    """The whole body: ``bytes`` up to :data:`SPOOL_OVER_BYTES`, a :class:`SpooledBody` over it.

    Each chunk bounded and counted by :func:`body_chunks`. Cancelled (the
    client went, the body timed out) or failed, its file is closed without
    waiting for a write still on its thread (:meth:`SpooledBody.close`), and
    the cancellation goes on at once.
    """
    pending: list[bytes] = []
    pending_bytes = 0
    size = 0
    body: SpooledBody | None = None
    spool = True  # until no file can be made
    try:
        async for chunk in body_chunks(request, budget, limit):
            pending.append(chunk)
            pending_bytes += len(chunk)
            size += len(chunk)
            if pending_bytes >= WRITE_BYTES and size > SPOOL_OVER_BYTES and spool:
                if body is None:
                    made = await asyncio.to_thread(_temporary_file)
                    if isinstance(made, OSError):
                        _no_file_log.event(
                            "cannot make a temporary file for a big request body in %s (%s): "
                            "such bodies are held in memory; set TMPDIR to a writable folder",
                            tempfile.gettempdir(),
                            made.strerror or made,
                        )
                        spool = False
                    else:
                        body = SpooledBody(made, 0)
                if body is not None:
                    # Meanwhile nothing reads the connection: aiohttp pauses it once
                    # its buffer is full, so a fast sender waits for the disk.
                    await asyncio.to_thread(body.append, pending)
                    pending, pending_bytes = [], 0
        if body is None:
            return pending[0] if len(pending) == 1 else b"".join(pending)
        if pending:
            await asyncio.to_thread(body.append, pending)
    except BaseException:
        if body is not None:
            body.close()
        raise
    return body


def read_back(body: SpooledBody) -> bytes:
    """On a thread: a spooled body, whole, and its file closed."""
    with body:
        return body.read(0, body.size)


def _temporary_file() -> BinaryIO | OSError:
    """On a thread: an unnamed temporary file, or why none can be made."""
    try:
        return tempfile.TemporaryFile(buffering=0)
    except OSError as exc:
        return exc
