"""The core's side of the fast path of ``http.workers``: KServe V2 ``/infer`` requests read
from a frontend's ring, served, and answered on its other ring (frontends layer, on the
core's loop).

A frontend that decoded an ``/infer`` body (:mod:`.fast_infer`) writes the
packed request (:mod:`aserve.codecs.v2_ring`) to its request ring. Here each
one is copied out of the ring (once: the inputs are read-only views of that
copy, as a binary HTTP body's are of the body), then served as the HTTP
route serves a request: counted and admitted by
:class:`~aserve.frontends.common.admit_and_count` under protocol ``http``
(so ``/metrics`` counts it once, as any HTTP request), routed, checked against
the model (:func:`~aserve.codecs.v2_ring.decode_packed`: the HTTP codec's own
checks and messages), its deadline resolved by
:func:`~aserve.frontends.common.resolve_deadline` from the frontend's arrival
stamp and the ``aserve-timeout-ms`` header it passed on, and handed to
``Runtime.infer``. The answer (or the error's code and message) goes back on
the answer ring; one over that ring's largest message is written to a file
in the private folder, which the frontend reads and removes.

A cancel record (the client went away) cancels that request's task; a
frontend that exits has every request it had in flight cancelled here, and
nobody else's.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aserve.codecs.v2_ring import decode_packed, pack_answer
from aserve.frontends.common import admit_and_count, as_error, resolve_deadline
from aserve.frontends.proc.rings import (
    RingFds,
    RingReceiver,
    RingSender,
    frame,
    map_ring,
    new_ring_fds,
    unframe,
)
from aserve.obs.logs import CURRENT, RequestInfo

if TYPE_CHECKING:
    from aserve.frontends.context import FrontendContext
    from aserve.loop.runtimes.base import Runtime

log = logging.getLogger("aserve.http")


class CoreRings:
    """The rings of one frontend process (made for each of its starts), served."""

    def __init__(self, ctx: FrontendContext, index: int, spill_dir: Path) -> None:
        self._ctx = ctx
        self._index = index
        self._spill_dir = spill_dir
        self._max_elements = ctx.config.limits.max_tensor_elements
        self._max_timeout_s = ctx.config.limits.max_timeout_ms / 1e3
        self._access_log = ctx.metrics.requests.access_log
        self.requests_fds = new_ring_fds(f"aserve-http-{index}-requests")
        self.answers_fds = new_ring_fds(f"aserve-http-{index}-answers")
        self._receiver: RingReceiver | None = None
        self._sender: RingSender | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.served = 0  # requests read from the ring

    @property
    def fds(self) -> list[int]:
        """What the frontend inherits: the request ring's then the answer ring's."""
        return [*self.requests_fds.all(), *self.answers_fds.all()]

    def start(self) -> None:
        self._sender = RingSender(map_ring(self.answers_fds), self.answers_fds)
        self._receiver = RingReceiver(
            map_ring(self.requests_fds), self.requests_fds, self._on_message
        )
        self._receiver.start()

    def stop(self) -> None:
        """The frontend is gone: its requests in flight cancelled, its rings closed."""
        if self._receiver is not None:
            self._receiver.stop()
        if self._sender is not None:
            self._sender.close()
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        for fds in (self.requests_fds, self.answers_fds):
            RingFds.close(fds)

    def _on_message(self, view: memoryview) -> None:
        header, tensors = unframe(view)
        n = header["n"]
        if header["k"] == "c":  # the client went away
            task = self._tasks.pop(n, None)
            if task is not None:
                task.cancel()
            return
        # The one copy out of the ring (its room goes back next): the tensors' bytes.
        self.served += 1
        self._tasks[n] = asyncio.create_task(self._serve(n, header, bytes(tensors)))

    async def _serve(self, n: int, header: dict[str, Any], tensors: bytes) -> None:
        runtime: Runtime | None = None
        try:
            if self._access_log:  # this task's own context: the request's alone
                CURRENT.set(RequestInfo(header["r"]))
            try:
                with admit_and_count(self._ctx, "http", lambda: runtime):
                    runtime = self._ctx.registry.get(header["m"], header["v"])
                    decoded = decode_packed(
                        header["h"], memoryview(tensors), runtime.name, runtime.input_specs,
                        runtime.output_specs, runtime.max_batch_size, runtime.variable_shapes,
                        self._max_elements,
                    )  # fmt: skip
                    timeout = resolve_deadline(
                        header["t"], decoded.timeout_s, None, runtime.default_timeout_s,
                        self._max_timeout_s,
                    )  # fmt: skip
                    outputs = await runtime.infer(
                        decoded.inputs, decoded.batch_size, decoded.shape_key, timeout,
                        decoded.client_id, decoded.parameters, arrival=header["a"],
                    )  # fmt: skip
                    entries, chunks = pack_answer(decoded, outputs, runtime.output_specs)
            except Exception as exc:
                error = as_error(exc, "an infer request from an HTTP frontend", header["r"])
                await self._send({"n": n, "e": error.code.value, "x": error.message})
                return
            answer = {"n": n, "m": runtime.name, "v": runtime.version, "o": entries}
            await self._send(answer, chunks)
        finally:
            self._tasks.pop(n, None)

    async def _send(self, answer: dict[str, Any], chunks: list[bytes] | None = None) -> None:
        sender = self._sender
        assert sender is not None
        parts = frame(answer, chunks or ())
        if sum(len(p) for p in parts) > sender.max_message:
            # Too big for the ring: in a file of the private folder, the frontend's to remove.
            path = self._spill_dir / f"answer-{self._index}-{answer['n']}"
            await asyncio.to_thread(path.write_bytes, b"".join(chunks or ()))
            parts = frame({**answer, "f": str(path)})
        await sender.send(parts)
