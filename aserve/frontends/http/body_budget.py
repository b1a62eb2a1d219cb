"""``limits.max_inflight_bytes``: the request bodies the HTTP frontend holds at once (on the loop).

Every route that reads a body reads it through :func:`body_chunks` (V2
``/infer``, Triton's generate, the OpenAI routes, ``/predictions``, the admin
routes). A body counts from the moment its request starts reading it until
the request's handler task ends, once its answer is sent: at first what its
Content-Length declares, so a body that cannot fit is refused before a byte
of it is read, then what has arrived, when more (a chunked body), and what
it inflated to (gzip, deflate). A request that would take the total over the limit is refused at
once: :class:`~aserve.errors.QueueFull`, HTTP 429 with ``Retry-After``, as
``limits.max_concurrency`` refuses, naming the limit, and counted under
``aserve_rejected_requests{reason="max_inflight_bytes"}``. What is left of
its body is read and dropped after the answer (aiohttp's lingering close, 10 s
at most), so that the client, still sending, reads its answer rather than a
reset connection; none of it is held. Refused rather than parked: a client
can retry elsewhere, and a parked body would hold its connection and the
bytes it sent already.

Without it, clients that send big bodies at once make the server hold all of
them (8 bodies of 60 MB to ``/predictions`` took 1.2 GB), however few
``max_concurrency`` allows, which is off by default.

No ``malloc_trim`` after big bodies: measured with ``bench/multipart_memory.py``,
the server's RSS after eight 60 MB bodies comes back to where it started
without it (what stayed before was aiohttp's multipart reader's 16 KiB
pieces, kept in glibc's heaps; see :mod:`aserve.frontends.http.multipart`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from aiohttp import web

from aserve.errors import QueueFull, TooLarge

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


async def read_counted(request: web.Request, budget: BodyBudget, limit: int) -> bytes:
    """The whole body, held in ``budget`` as it arrives; :class:`TooLarge` past ``limit``.

    Read chunk by chunk rather than with ``request.read()``, which holds a
    growing bytearray and a copy of it, and keeps the copy on the request for
    as long as the request lives.
    """
    chunks = [chunk async for chunk in body_chunks(request, budget, limit)]
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


async def body_chunks(request: web.Request, budget: BodyBudget, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, each counted in ``budget`` and against
    ``limit`` (``max_request_bytes``) before it is handed on."""
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
