"""Log output: text or JSON lines, the access log, and request ids.

Every answered request goes through :meth:`aserve.frontends.common.RequestMetrics.record`;
with ``"logging": {"access_log": true}`` that also writes one line to the
``aserve.access`` logger: request id, protocol, model, version, status,
duration, and where known the time queued and the time computing.

The request id is the client's ``x-request-id`` (HTTP header or gRPC
metadata) when it is a sane one, else one made here; HTTP answers carry it
back in ``x-request-id``. It travels with the request in a context variable
(:data:`CURRENT`), which the handler's task and everything it awaits share,
so the runtime that queued the request can add its timings without any
signature in between knowing of it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import Any

import orjson

ACCESS = logging.getLogger("aserve.access")
REQUEST_ID_HEADER = "X-Request-Id"


class RequestInfo:
    """What the access log says of one request beyond its counters."""

    __slots__ = ("compute_s", "id", "queue_s")

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.queue_s: float | None = None  # arrival -> its batch (or first step) started
        self.compute_s: float | None = None  # its batch's time in the engine


CURRENT: ContextVar[RequestInfo | None] = ContextVar("aserve_request", default=None)


def access_record(
    info: RequestInfo | None,
    protocol: str,
    model: str,
    version: str,
    status: str,
    duration_s: float,
) -> None:
    """Write one access-log line (call only when the access log is on)."""
    fields: dict[str, Any] = {
        "request_id": info.id if info is not None else None,
        "protocol": protocol,
        "model": model or None,
        "version": version or None,
        "status": status,
        "duration_ms": round(duration_s * 1e3, 3),
    }
    if info is not None:
        if info.queue_s is not None:
            fields["queue_ms"] = round(info.queue_s * 1e3, 3)
        if info.compute_s is not None:
            fields["compute_ms"] = round(info.compute_s * 1e3, 3)
    level = logging.WARNING if status == "internal" else logging.INFO
    ACCESS.log(
        level,
        "%s",
        " ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
        extra={"fields": fields},
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields is not None:
            doc.update(fields)
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# The format, for the server's child processes (step processes log the same way).
FORMAT_ENV = "ASERVE_LOG_FORMAT"


def configure(level: str, fmt: str) -> None:
    """Send the server's logs to stderr as text or JSON lines (replacing any setup)."""
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
