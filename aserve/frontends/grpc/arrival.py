"""When a gRPC call arrived, for its deadline (frontends layer; on the loop).

A request's deadline counts from when it arrived (docs/guide/batching.md,
"A request's deadline"). grpc.aio keeps no start time of a call that Python
can read: the call's deadline (``time_remaining()``) is the client's end of
it, not its start, and the HTTP/2 frames are read inside grpc's core. The
earliest Python sees of a call is a server interceptor: grpc.aio runs the
interceptors first in the call's own task, once its headers are in, before
it reads the request message and before the servicer runs. So :class:`ArrivalInterceptor`, the first interceptor,
notes the time there in a context variable that the servicer, in the same
task, reads with :func:`call_budget`.

The time is the call's: a unary call's request, and a server-streaming
call's. The requests of a client stream (ModelStreamInfer) come one by one
long after the call began; each counts from when it was read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from time import monotonic
from typing import Any

import grpc

_ARRIVAL: ContextVar[float | None] = ContextVar("aserve_grpc_arrival", default=None)


class ArrivalInterceptor(grpc.aio.ServerInterceptor):
    """Notes when each call arrived (``time.monotonic()``); for :func:`call_budget`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # The call's task has a context of its own: the value is this call's alone.
        _ARRIVAL.set(monotonic())
        return await continuation(handler_call_details)


def call_budget(context: Any) -> tuple[float | None, float | None]:
    """The call's arrival (None: not noted) and its deadline as seconds from then
    (None: the client set none), for :func:`~aserve.frontends.common.resolve_deadline`
    and ``Runtime.infer``: ``time_remaining()`` is measured now, so the time since
    the arrival is added back; the deadline itself is the client's."""
    arrival = _ARRIVAL.get()
    remaining = context.time_remaining()
    if arrival is None or remaining is None:
        return arrival, remaining
    return arrival, remaining + (monotonic() - arrival)
