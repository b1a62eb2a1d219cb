"""Server-wide admission: how many inference requests are served at once (on the loop).

``limits.max_concurrency`` bounds the requests both frontends serve together.
A frontend enters :class:`Admission` around each inference request (``with
server.admission:``); over the limit, entering raises
:class:`~aserve.errors.QueueFull` at once (HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED), nothing is parked. With no limit, entering is a counter
increment.
"""

from __future__ import annotations

from types import TracebackType

from aserve.errors import QueueFull


class Admission:
    """Counts inference requests in flight; refuses those over ``limit`` (None: no limit).

    ``rejected`` is the refusal counter by reason that /metrics exports; this
    object adds to its ``"max_concurrency"`` entry.
    """

    __slots__ = ("inflight", "limit", "rejected")

    def __init__(self, limit: int | None, rejected: dict[str, int]) -> None:
        self.limit = limit
        self.inflight = 0
        self.rejected = rejected

    def __enter__(self) -> None:
        # No await between the check and the increment: the count is exact.
        if self.limit is not None and self.inflight >= self.limit:
            self.rejected["max_concurrency"] = self.rejected.get("max_concurrency", 0) + 1
            raise QueueFull(
                f"server is serving {self.inflight} requests, its limit "
                f"limits.max_concurrency is {self.limit}; retry later"
            )
        self.inflight += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.inflight -= 1
