"""The one error hierarchy of aserve.

Every failure a client can see is an :class:`AserveError` carrying a stable
:class:`ErrorCode`. Engines, the scheduler and the codecs raise these and never
import HTTP or gRPC types; one table maps each code to its HTTP status and its
gRPC status code (``frontends/status.py``), which both frontends use.

Messages name what was wrong: the field, the tensor, the value and the limit.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Stable error codes; frontends map them to wire statuses."""

    INVALID_ARGUMENT = "invalid_argument"  # bad JSON, tensor, shape, dtype, parameter
    NOT_FOUND = "not_found"  # unknown model or version
    TOO_LARGE = "too_large"  # body or tensor over a configured limit
    QUEUE_FULL = "queue_full"  # admission refused: the model's queue is full
    UNAVAILABLE = "unavailable"  # not ready, draining, or the deadline cannot be met
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's deadline passed
    CANCELLED = "cancelled"  # the client went away or cancelled
    REQUEST_TIMEOUT = "request_timeout"  # the client did not send its request body in time
    UNIMPLEMENTED = "unimplemented"  # a protocol feature aserve does not offer
    INTERNAL = "internal"  # the model or the server failed


class AserveError(Exception):
    """Base of every error a client may receive."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        if not message.isascii():
            # A message may quote what a client sent: undecodable header bytes
            # arrive as lone surrogates, which neither JSON nor gRPC can carry.
            message = message.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.message = message


class InvalidArgument(AserveError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(AserveError):
    code = ErrorCode.NOT_FOUND


class TooLarge(AserveError):
    code = ErrorCode.TOO_LARGE


class QueueFull(AserveError):
    code = ErrorCode.QUEUE_FULL


class Unavailable(AserveError):
    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(AserveError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Cancelled(AserveError):
    code = ErrorCode.CANCELLED


class RequestTimeout(AserveError):
    code = ErrorCode.REQUEST_TIMEOUT


class Unimplemented(AserveError):
    code = ErrorCode.UNIMPLEMENTED


class InternalError(AserveError):
    code = ErrorCode.INTERNAL
