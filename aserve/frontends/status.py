"""The one table from error code to wire status, for both frontends.

Each :class:`~aserve.errors.ErrorCode` maps to an HTTP status and a gRPC
status code here and nowhere else, so the same failure reads the same over
REST and gRPC. The derived per-frontend dicts are what the hot paths index.

Frontends layer, pure tables.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import grpc

from aserve.errors import ErrorCode

# The ``status`` label of an answered request: "ok", or an ErrorCode value
# ("invalid_argument", "queue_full", ..., "cancelled" when the client left).
OK: Final = "ok"


class WireStatus(NamedTuple):
    http: int
    grpc: grpc.StatusCode


STATUS: Final[dict[ErrorCode, WireStatus]] = {
    ErrorCode.INVALID_ARGUMENT: WireStatus(400, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorCode.NOT_FOUND: WireStatus(404, grpc.StatusCode.NOT_FOUND),
    # Both refusals ask the client to send less or later: one gRPC code.
    ErrorCode.TOO_LARGE: WireStatus(413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorCode.QUEUE_FULL: WireStatus(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorCode.UNAVAILABLE: WireStatus(503, grpc.StatusCode.UNAVAILABLE),
    ErrorCode.DEADLINE_EXCEEDED: WireStatus(504, grpc.StatusCode.DEADLINE_EXCEEDED),
    ErrorCode.CANCELLED: WireStatus(499, grpc.StatusCode.CANCELLED),
    # HTTP only (gRPC bounds a slow sender with its own flow control and the call's deadline).
    ErrorCode.REQUEST_TIMEOUT: WireStatus(408, grpc.StatusCode.DEADLINE_EXCEEDED),
    ErrorCode.UNIMPLEMENTED: WireStatus(501, grpc.StatusCode.UNIMPLEMENTED),
    ErrorCode.INTERNAL: WireStatus(500, grpc.StatusCode.INTERNAL),
}
assert set(STATUS) == set(ErrorCode), "every error code needs a wire status"

HTTP_STATUS: Final[dict[ErrorCode, int]] = {code: s.http for code, s in STATUS.items()}
GRPC_STATUS: Final[dict[ErrorCode, grpc.StatusCode]] = {code: s.grpc for code, s in STATUS.items()}

# HTTP status -> the request counters' status label (the error code's value; "ok" for 200).
STATUS_LABELS: Final[dict[int, str]] = {
    200: OK,
    **{s.http: code.value for code, s in STATUS.items()},
}


def status_label(http_status: int) -> str:
    """The counters' status label of an HTTP answer that :data:`STATUS_LABELS` lacks."""
    label = STATUS_LABELS.get(http_status)
    if label is not None:
        return label
    if http_status < 400:
        return OK
    return (ErrorCode.INTERNAL if http_status >= 500 else ErrorCode.INVALID_ARGUMENT).value
