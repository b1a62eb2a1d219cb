"""The gRPC inference calls in flight (frontends layer, on the loop).

:class:`InFlight` bounds them by ``limits.max_connections`` (grpc multiplexes
calls on few connections, so calls are what is bounded) and tells the drain
when none is left. A call counts until grpc has sent its status, not until
its handler returns: its answer is written after that, and a drain that
ended at the return would let the final stop cancel an answer still on its
way (the client sees CANCELLED or a GOAWAY).
"""

from __future__ import annotations

import asyncio

import grpc

from aserve.errors import QueueFull


class InFlight:
    """Unary and streaming inference calls being served."""

    def __init__(self, max_calls: int | None, rejected: dict[str, int]) -> None:
        self.count = 0
        self._max_calls = max_calls
        self._rejected = rejected
        self.idle = asyncio.Event()
        self.idle.set()

    def admit(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse the call past ``limits.max_connections``, else count it in flight."""
        self.check_capacity()
        self.serving(context)

    def check_capacity(self) -> None:
        """Raise :class:`QueueFull` when ``limits.max_connections`` inference calls
        are in flight. Call right before :meth:`serving`, with no await between."""
        if self._max_calls is not None and self.count >= self._max_calls:
            self._rejected["max_connections"] = self._rejected.get("max_connections", 0) + 1
            raise QueueFull(
                f"server has {self.count} gRPC inference calls in flight, its limit "
                f"limits.max_connections is {self._max_calls}; retry later"
            )

    def serving(self, context: grpc.aio.ServicerContext) -> None:
        """Count an inference call as in flight until grpc has sent its status."""
        self.count += 1
        self.idle.clear()
        context.add_done_callback(self._call_done)

    def _call_done(self, _context: object) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


def end_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with ``code`` once the handler returns (a unary handler then
    returns None: grpc sends no message with a status that is not OK).

    Not ``context.abort()``: grpc.aio keeps its exception in a reference
    cycle with the handler's frame, and so with the request (megabytes, for a
    refused big tensor or prompt) until the garbage collector runs.
    """
    context.set_code(code)
    context.set_details(message)
