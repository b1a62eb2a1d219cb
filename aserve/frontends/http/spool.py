"""A big request body written to a temporary file as it arrives (``/predictions``; on the loop).

A body held in memory is held twice at its end (its pieces and their join)
and copied by calls that keep the GIL: joining 60 MB takes about 30 ms, in
which the event loop's thread cannot run, whichever thread does it. So
``/predictions`` bodies over :data:`SPOOL_OVER_BYTES` go to an unnamed
temporary file instead (``tempfile.TemporaryFile``: in ``$TMPDIR``, opened
with ``O_TMPFILE`` where Linux has it, so it has no name and nothing is
left behind by a process that dies), :data:`WRITE_BYTES` at a time on a
thread (``os.writev`` lets go of the GIL), and are read back on a thread by
``os.pread`` (which lets go of it too): the multipart split reads each
part's data straight into its own ``bytes``
(:mod:`aserve.frontends.http.multipart`), a raw body is read back whole.
What the server holds in memory then is about what the handler gets, once.
The file is closed, and so gone, as soon as the body has been read back,
before the handler runs; if the request fails first, when it fails. Where no
temporary file can be made (a read-only ``$TMPDIR``), big bodies are held in
memory, logged; a disk that refuses a write (full) fails the request with
503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from typing import BinaryIO

from aiohttp import web

from aserve.errors import Unavailable
from aserve.frontends.http.body_budget import BodyBudget, body_chunks
from aserve.obs.log_throttle import Throttled

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

    Bounded as :func:`aserve.frontends.http.body_budget.read_counted` bounds a body.
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
