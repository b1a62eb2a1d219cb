"""Request bodies: how many bytes the HTTP frontend holds at once, and where (on the loop).

Every route reads its body here (V2 ``/infer``, Triton's generate, the
OpenAI routes, ``/predictions``, the admin routes), through
:func:`read_spooled`.

**How much: ``limits.max_inflight_bytes``** (:class:`BodyBudget`). A body
counts from the moment its request starts reading it until the request's
handler task ends, once its answer is sent: at first what its
Content-Length declares, so a body that cannot fit is refused before a byte
of it is read, then what has arrived, when more (a chunked body), and what
it inflated to (gzip, deflate). A request that would take the total over
the limit is refused at once: :class:`~aserve.errors.QueueFull`, HTTP 429
with ``Retry-After``, as ``limits.max_concurrency`` refuses, naming the
limit, and counted under ``aserve_rejected_requests{reason="max_inflight_bytes"}``.
What is left of its body is read and dropped after the answer (aiohttp's
lingering close, 10 s at most), so that the client, still sending, reads its
answer rather than a reset connection; none of it is held. Refused rather
than parked: a client can retry elsewhere, and a parked body would hold its
connection and the bytes it sent already. A body that has all arrived with
its request's head is not counted (the app reads it without coming here):
it is in memory already, and small: aiohttp stops reading a connection
once 128 KiB is buffered, so such a body is a few hundred KiB at most. Without the bound, clients that send big
bodies at once made the server hold all of them (8 bodies of 60 MB to
``/predictions`` took 1.2 GB), however few ``max_concurrency`` allows,
which is off by default.

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

No ``malloc_trim`` after big bodies: measured with ``bench/multipart_memory.py``,
the server's RSS after eight 60 MB bodies comes back to where it started
without it (what stayed before was aiohttp's multipart reader's 16 KiB
pieces, kept in glibc's heaps).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator
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
        """Count ``total`` bytes for ``request``'s body (when more than it counts already).

        Raises :class:`QueueFull` when that would take the total over the limit.
        """
        had = request.get(HELD_KEY, 0)
        extra = total - had
        if extra <= 0:
            return
        if self.held + extra > self.limit:
            self._rejected["max_inflight_bytes"] = self._rejected.get("max_inflight_bytes", 0) + 1
            raise QueueFull(
                f"request body of {total} bytes: the server holds {self.held} bytes of "
                f"request bodies, its limit limits.max_inflight_bytes is {self.limit}; "
                "retry later"
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

    Read chunk by chunk rather than with ``request.read()``, which holds a
    growing bytearray and a copy of it, and keeps the copy on the request for
    as long as the request lives.
    """
    declared = request.content_length
    if declared:
        if declared > limit:
            raise TooLarge(
                f"request body is {declared} bytes, over the limit max_request_bytes {limit}"
            )
        budget.hold(request, declared)
    stream = request.content
    size = 0
    while chunk := await stream.readany():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body is over the limit max_request_bytes {limit}")
        if declared is None or size > declared:
            budget.hold(request, size)
        yield chunk


# --- where: a temporary file -----------------------------------------------------

SPOOL_OVER_BYTES = 1 << 20  # a body over this goes to a file
WRITE_BYTES = 1 << 20  # written this much at a time
_IOV_MAX = 512  # pieces per writev (Linux takes 1024)

_no_file_log = Throttled(logging.getLogger("aserve.http"), logging.WARNING)


class SpooledBody:
    """A request body in an unnamed temporary file: :meth:`read` it on a thread, then
    :meth:`close` it (or use it as a context manager), after which it is gone.

    Reads and the close take one lock: a read on a thread that outlived its
    request (a handler thread still running past a deadline) finds the file
    closed rather than a descriptor the process has reused meanwhile.
    """

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self.size = size
        self._lock = threading.Lock()

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``start`` to ``stop`` (clipped to the body), by ``pread``."""
        stop = min(stop, self.size)
        if stop <= start:
            return b""
        with self._lock:
            if self._file.closed:
                raise ValueError("the spooled request body is closed")
            fd = self._file.fileno()
            data = os.pread(fd, stop - start, start)
            while len(data) < stop - start:  # a short read: rare for a regular file
                more = os.pread(fd, stop - start - len(data), start + len(data))
                if not more:
                    raise OSError(f"spooled request body ends at {start + len(data)}")
                data += more
            return data

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> SpooledBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def read_spooled(request: web.Request, budget: BodyBudget, limit: int) -> bytes | SpooledBody:
    """The whole body: ``bytes`` up to :data:`SPOOL_OVER_BYTES`, a :class:`SpooledBody` over it.

    Each chunk bounded and counted by :func:`body_chunks`.
    """
    pending: list[bytes] = []
    pending_bytes = 0
    size = 0
    file: BinaryIO | None = None
    spool = True  # until no file can be made
    try:
        async for chunk in body_chunks(request, budget, limit):
            pending.append(chunk)
            pending_bytes += len(chunk)
            size += len(chunk)
            if pending_bytes >= WRITE_BYTES and size > SPOOL_OVER_BYTES and spool:
                if file is None:
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
                        file = made
                if file is not None:
                    # Meanwhile nothing reads the connection: aiohttp pauses it once
                    # its buffer is full, so a fast sender waits for the disk.
                    await asyncio.to_thread(_write_all, file, pending)
                    pending, pending_bytes = [], 0
        if file is None:
            return pending[0] if len(pending) == 1 else b"".join(pending)
        if pending:
            await asyncio.to_thread(_write_all, file, pending)
    except BaseException:
        if file is not None:
            file.close()
        raise
    return SpooledBody(file, size)


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


def _write_all(file: BinaryIO, pieces: list[bytes]) -> None:
    """On a thread: every piece, in order, at the file's end; :class:`Unavailable`
    (503) when the disk refuses (full, say)."""
    try:
        _writev_all(file.fileno(), pieces)
    except OSError as exc:
        raise Unavailable(
            f"request body: cannot write it to a temporary file in {tempfile.gettempdir()} "
            f"({exc.strerror or exc}); retry later"
        ) from None


def _writev_all(fd: int, pieces: list[bytes]) -> None:
    while pieces:
        written = os.writev(fd, pieces[:_IOV_MAX])
        # A short write: drop what went, go on with the rest.
        while pieces and written >= len(pieces[0]):
            written -= len(pieces[0])
            pieces = pieces[1:]
        if written:
            pieces[0] = pieces[0][written:]
