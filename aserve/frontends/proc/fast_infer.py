"""The fast path of a frontend process: KServe V2 ``/infer`` handed to the core over the
shared-memory rings (frontends layer; in a frontend process, on its loop).

``POST /v2/models/{model}[/versions/{version}]/infer`` with a
Content-Length, no Content-Encoding to inflate or Accept-Encoding to
compress, within ``limits.max_request_bytes`` and the ring's largest message
(a body still arriving is read within ``http.body_timeout_s``, under this
frontend's share of ``limits.max_inflight_bytes``, else forwarded) and, when
API keys are configured, a valid key (the core hands each frontend the keys
it loaded, over its control channel): the body is decoded here
(:func:`~aserve.codecs.v2_ring.pack_request`), the packed request written to
the request ring with the arrival stamp, the ``aserve-timeout-ms`` header
and the request id, and the answer, read from the answer ring, encoded as
the core's route would (JSON or binary). Every other request, a body the
decoding here does not take and one without a valid key, goes to the core
whole (:class:`~.proxy.CoreProxy`), which answers it (refusals and errors in
its own words) as without frontends.

A client that goes away while its request is in the core sends a cancel
record; the core cancels the request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from aserve.codecs.timeouts import TIMEOUT_HEADER
from aserve.codecs.v2_ring import encode_packed, pack_request
from aserve.errors import AserveError, InternalError, InvalidArgument, RequestTimeout
from aserve.frontends.auth import ApiKeys
from aserve.frontends.common import request_id
from aserve.frontends.http.kit import ARRIVAL_KEY, JSON, error_response
from aserve.frontends.proc.proxy import CoreProxy
from aserve.frontends.proc.rings import RingFds, RingReceiver, RingSender, frame, map_ring, unframe
from aserve.frontends.roles import Role
from aserve.obs.logs import REQUEST_ID_HEADER

log = logging.getLogger("aserve.http.frontend")

IHCL = "Inference-Header-Content-Length"
RING_HEADER = "aserve-ring"  # on the answers that took the fast path
# Room for the record's framing and msgpack header beside the tensors.
_HEADER_ROOM_BYTES = 64 * 1024
# The error class of each code, to answer a core's error as the core's route would.
_ERRORS: dict[str, type[AserveError]] = {
    cls.code.value: cls for cls in AserveError.__subclasses__()
}


class FastInfer:
    """The ``/infer`` route of a frontend process, over the rings in ``fds``."""

    def __init__(
        self,
        proxy: CoreProxy,
        requests: RingFds,
        answers: RingFds,
        settings: dict[str, Any],
        keys: ApiKeys | None = None,
    ) -> None:
        self._proxy = proxy
        self._keys = keys
        self._requests_fds = requests
        self._answers_fds = answers
        self._max_body = settings["max_request_bytes"]
        self._inflight_budget = settings["inflight_share_bytes"]
        self._body_timeout_s = float(settings["http"]["body_timeout_s"])
        self._held = 0  # bytes of bodies being read here
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self._sender: RingSender | None = None
        self._receiver: RingReceiver | None = None
        self._late: set[asyncio.Task[None]] = set()  # cancels waiting for room

    def start(self) -> None:
        self._sender = RingSender(map_ring(self._requests_fds), self._requests_fds)
        self._receiver = RingReceiver(
            map_ring(self._answers_fds), self._answers_fds, self._on_answer
        )
        self._receiver.start()

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.stop()

    def _on_answer(self, view: memoryview) -> None:
        header, data = unframe(view)
        waiter = self._waiting.get(header["n"])
        if waiter is not None and not waiter.done():
            waiter.set_result((header, bytes(data)))  # copied: the ring's room goes back
        elif "f" in header:  # its client has gone: nobody reads the file the core wrote
            Path(header["f"]).unlink(missing_ok=True)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        sender = self._sender
        headers = request.headers
        length = request.content_length
        if (
            sender is None
            # A request without a valid key goes to the core, which refuses it in its
            # own words (or serves it, on an open path); any valid key may infer.
            or (
                self._keys is not None
                and not isinstance(self._keys.check(headers.get("Authorization")), Role)
            )
            or length is None
            or length > self._max_body
            or length + _HEADER_ROOM_BYTES > sender.max_message
            or headers.get("Content-Encoding", "identity").strip().lower() != "identity"
            or (
                "Accept-Encoding" in headers
                and headers["Accept-Encoding"].strip().lower() in ("gzip", "deflate")
            )
        ):
            return await self._proxy.forward(request)
        if request.content.is_eof():  # all of it came with the head (most requests)
            return await self._infer(request, await request.read())
        # Still arriving: read here within http.body_timeout_s, under this frontend's
        # share of limits.max_inflight_bytes; over that share, the core's own rules.
        if self._held + length > self._inflight_budget:
            return await self._proxy.forward(request)
        self._held += length
        try:
            try:
                async with asyncio.timeout(self._body_timeout_s):
                    body = await request.read()
            except TimeoutError:
                response = error_response(
                    RequestTimeout(
                        "request body not received within http.body_timeout_s "
                        f"({self._body_timeout_s:g} s)"
                    )
                )
                response.force_close()  # the rest of the body may still be coming
                return response
            except web.RequestPayloadError as exc:
                return error_response(InvalidArgument(f"request body cannot be read: {exc}"))
            return await self._infer(request, body)
        finally:
            self._held -= length

    async def _infer(self, request: web.Request, body: bytes) -> web.StreamResponse:
        sender = self._sender
        assert sender is not None
        headers = request.headers
        packed = pack_request(body, headers.get(IHCL))
        if packed is None:
            return await self._proxy.forward(request, body)
        info = request.match_info
        rid = request_id(headers.get(REQUEST_ID_HEADER))
        n = next(self._ids)
        header = {
            "k": "r", "n": n, "m": info["model"], "v": info.get("version"),
            "a": request[ARRIVAL_KEY], "t": headers.get(TIMEOUT_HEADER), "r": rid,
            "h": packed.header,
        }  # fmt: skip
        parts = frame(header, packed.tensors)
        if sum(len(p) for p in parts) > sender.max_message:
            return await self._proxy.forward(request, body)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()
        self._waiting[n] = waiter
        sent = False
        try:
            await sender.send(parts)
            sent = True
            answer, data = await waiter
        except asyncio.CancelledError:
            # The client went away (the cancel cancelled the waiter too, unless the
            # answer had come): the core cancels the request.
            if sent and (waiter.cancelled() or not waiter.done()):
                cancel = frame({"k": "c", "n": n})
                if not sender.try_send(cancel):  # full: sent once there is room
                    task = loop.create_task(sender.send(cancel))
                    self._late.add(task)
                    task.add_done_callback(self._late.discard)
            raise
        finally:
            del self._waiting[n]
        if "e" in answer:
            error = _ERRORS.get(answer["e"], InternalError)
            response = error_response(error(answer["x"]))
        else:
            if "f" in answer:  # too big for the ring: the core wrote it to a file
                data = await asyncio.to_thread(_take_file, answer["f"])
            payload, json_length = encode_packed(
                answer["m"], answer["v"], packed, answer["o"], memoryview(data)
            )
            out: dict[str, str] = {}
            if json_length is not None:
                out[IHCL] = str(json_length)
                content_type = "application/octet-stream"
            else:
                content_type = JSON
            response = web.Response(body=payload, content_type=content_type, headers=out)
        response.headers[REQUEST_ID_HEADER] = rid
        response.headers[RING_HEADER] = "1"
        return response


def _take_file(path: str) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    finally:
        p.unlink(missing_ok=True)
