"""What every route of both frontends shares (frontends layer; on the loop, no I/O).

- :func:`resolve_deadline`: the one deadline rule. A request may ask for a
  timeout three ways: the ``aserve-timeout-ms`` header (HTTP), a body
  parameter (``timeout_ms``, or Triton's ``timeout`` in microseconds; gRPC
  Generate's ``timeout_ms`` field) and the gRPC call's deadline. Its timeout
  is the earliest of those it gives, or the model's default when it gives
  none; either way no later than ``limits.max_timeout_ms``. A given value
  that is not a finite positive number (``inf``, ``NaN``, ``1e309``, ``0``,
  ``-1``, text) is refused with :class:`InvalidArgument` naming the field:
  "no deadline" is not a deadline, and a request nobody bounds would hold its
  queue slot forever. (Body parameters are parsed where the body is decoded,
  by :func:`aserve.codecs.timeouts.parameter_timeout_s`.) The timeout counts
  from the request's arrival, which the frontend hands ``Runtime.infer``:
  when its first bytes were read (HTTP: the app's connection protocol; gRPC:
  :mod:`aserve.frontends.grpc.arrival`), so the time before its handler ran
  is spent from it.
- :class:`admit_and_count`: admission (:class:`Admission`,
  ``limits.max_concurrency``: how many inference requests both frontends
  serve at once; over it, refused at once with QueueFull, nothing parked)
  for as long as a request runs, then one count under its runtime, protocol
  and status in :class:`RequestMetrics` (server-wide, read by /metrics and
  the dashboard at scrape time).
- :func:`request_id` and :func:`track_grpc`: the request id the access log
  and the ``x-request-id`` answer header carry.
- The names both frontends use: :data:`TIMEOUT_HEADER`, :data:`FINAL` and
  :data:`EMPTY_FINAL` (Triton's decoupled flags), :func:`as_error`,
  :func:`bool_parameter`, :func:`usage` and the :data:`Route` alias.
- :func:`model_metadata` and :func:`model_listing`: what both frontends say
  of the models routed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from time import perf_counter
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

# TIMEOUT_HEADER: the frontends' name for it is this module's (see above).
from aserve.codecs.timeouts import TIMEOUT_HEADER as TIMEOUT_HEADER
from aserve.codecs.timeouts import header_timeout_s
from aserve.errors import AserveError, ErrorCode, InternalError, QueueFull
from aserve.frontends.status import OK
from aserve.obs.logs import CURRENT, RequestInfo, access_record
from aserve.obs.stats import LATENCY_BUCKETS_S, Histogram

if TYPE_CHECKING:
    from aserve._proto import grpc_service_pb2 as pb
    from aserve.frontends.context import FrontendContext
    from aserve.loop.registry import ModelRegistry
    from aserve.loop.runtimes.base import Runtime
    from aserve.types.generation import Delta

log = logging.getLogger("aserve.frontends")

FINAL: Final = "triton_final_response"
EMPTY_FINAL: Final = "triton_enable_empty_final_response"

# How a route is added to the HTTP app: route(method, path, handler).
Route = Callable[[str, str, Any], None]


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


class RequestMetrics:
    """Requests the frontends answered, by model, version, protocol and status.

    Server-wide (not per runtime), so counts survive reloads. Requests that
    name no served model count under ``model=""``, so that clients cannot
    create series by inventing names. Loop only.
    """

    def __init__(self, access_log: bool = False) -> None:
        self.access_log = access_log  # also write each request to the access log
        self.counts: dict[tuple[str, str, str, str], int] = {}
        self.durations: dict[tuple[str, str], Histogram] = {}
        # Refusals by a server-wide limit (reason -> count), no model known yet.
        self.rejected: dict[str, int] = {}

    def record(self, runtime: Any, protocol: str, status: str, started: float) -> None:
        """Count one answered request; ``started`` is its ``perf_counter()`` at arrival.

        ``runtime`` is the model runtime that served it, or None. The end-to-end
        duration histogram takes successful requests only (Triton's convention).
        """
        if runtime is None:
            model = version = ""
        else:
            model, version = runtime.name, runtime.version
        key = (model, version, protocol, status)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        if status == OK:
            hist = self.durations.get((model, version))
            if hist is None:
                hist = self.durations[(model, version)] = Histogram(LATENCY_BUCKETS_S)
            hist.observe(perf_counter() - started)
        if self.access_log:
            access_record(CURRENT.get(), protocol, model, version, status, perf_counter() - started)


_MAX_ID_LENGTH = 128


def request_id(given: str | None) -> str:
    """``given`` if it is a printable ASCII id of at most 128 characters, else a new one."""
    if given and len(given) <= _MAX_ID_LENGTH and given.isascii() and given.isprintable():
        return given
    return os.urandom(8).hex()


def track_grpc(context: Any, access_log: bool) -> None:
    """Give a gRPC call its request id (metadata ``x-request-id``) for the access
    log; without the access log nothing reads it, so nothing is done."""
    if access_log:
        given = next(
            (v for k, v in context.invocation_metadata() or () if k == "x-request-id"), None
        )
        CURRENT.set(RequestInfo(request_id(given if isinstance(given, str) else None)))


def resolve_deadline(
    header: str | None,
    parameter_s: float | None,
    call_s: float | None,
    default_s: float,
    max_s: float,
) -> float:
    """The request's timeout in seconds from its arrival: the earliest of the
    ``aserve-timeout-ms`` ``header`` (its raw value), the body's ``parameter_s``
    and the gRPC call's ``call_s`` (its deadline from the arrival,
    :func:`aserve.frontends.grpc.arrival.call_budget`; a deadline already passed
    is answered DEADLINE_EXCEEDED by the runtime), each None when not given, else
    ``default_s`` (the model's); at most ``max_s`` (``limits.max_timeout_ms``)."""
    timeout = default_s
    if header is not None or parameter_s is not None or call_s is not None:
        given = [t for t in (header_timeout_s(header), parameter_s, call_s) if t is not None]
        timeout = min(given)
    return timeout if timeout < max_s else max_s


class admit_and_count:  # lower case: it reads as a function, `with admit_and_count(...)`
    """``with admit_and_count(ctx, protocol, served) as call:`` one inference request.

    Runs ``gate`` (gRPC's bound on calls, ``limits.max_connections``), if any,
    then enters the server's admission (``limits.max_concurrency``); a refusal
    by either raises its :class:`~aserve.errors.QueueFull`, counted. On leaving it counts one
    request under ``served()`` (the runtime that served it, or None),
    ``protocol`` and its status: ``call.status`` (``"ok"`` unless the route
    sets another) when the block ends normally, else the error that ended it
    (``cancelled`` for a client gone, ``internal`` for a bug). The same for
    HTTP routes (``served`` reads the runtime the handler stored) and gRPC.
    """

    __slots__ = ("_admission", "_gate", "_protocol", "_record", "_served", "_started", "status")

    def __init__(
        self,
        ctx: FrontendContext,
        protocol: str,
        served: Callable[[], Any],
        gate: Callable[[], None] | None = None,
    ) -> None:
        self._started = perf_counter()
        self._admission = ctx.admission
        self._record = ctx.metrics.requests.record
        self._protocol = protocol
        self._served = served
        self._gate = gate
        self.status = OK

    def __enter__(self) -> admit_and_count:
        try:
            if self._gate is not None:
                self._gate()
            self._admission.__enter__()
        except AserveError as exc:
            self._record(self._served(), self._protocol, exc.code.value, self._started)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._admission.__exit__(exc_type, exc, tb)
        if exc is None:
            status = self.status
        elif isinstance(exc, AserveError):
            status = exc.code.value
        elif isinstance(exc, Exception):
            status = ErrorCode.INTERNAL.value  # a bug
        else:  # CancelledError, or GeneratorExit for a stream nobody reads on
            status = ErrorCode.CANCELLED.value
        self._record(self._served(), self._protocol, status, self._started)


def as_error(exc: Exception, what: str, request_id: str = "") -> AserveError:
    """``exc`` as the error to answer: itself, its traceback dropped, when it is an
    :class:`AserveError`; anything else is a bug, not the client's fault: logged,
    answered INTERNAL."""
    if isinstance(exc, AserveError):
        # The client is told the message, not the traceback; kept with the error
        # in a handler's local, the traceback would hold the handler's frame (and
        # its request, megabytes maybe) in a cycle until the garbage collector runs.
        return exc.with_traceback(None)
    log.exception("%s (request id %r) failed unexpectedly", what, request_id)
    return InternalError(f"internal error: {exc!r}")


def bool_parameter(request: pb.ModelInferRequest, key: str) -> bool:
    """Whether a ModelInferRequest's parameter ``key`` is the bool true."""
    param = request.parameters.get(key)
    return (
        param is not None
        and param.WhichOneof("parameter_choice") == "bool_param"
        and param.bool_param
    )


def model_metadata(registry: ModelRegistry, runtime: Runtime) -> dict[str, Any]:
    """KServe's model metadata of ``runtime``, its ``versions`` every routed
    version of the model (the ones a request may name), whichever was asked."""
    return {**runtime.metadata(), "versions": registry.versions(runtime.name)}


def model_listing(registry: ModelRegistry) -> list[dict[str, Any]]:
    """Every routed model version with its state (``GET /v2/models``): what an
    inference key may reach. The config's models that are not routed (unloaded,
    failed) are the repository index's, an admin's."""
    return [
        {"name": rt.name, "version": rt.version, "state": rt.state.value,
         "platform": rt.metadata().get("platform", "")}
        for rt in sorted(registry, key=lambda rt: (rt.name, int(rt.version)))
    ]  # fmt: skip


def usage(delta: Delta | None) -> dict[str, int]:
    """A generation's token counts from its last delta, as OpenAI and Triton answer them."""
    prompt = delta.prompt_tokens if delta else 0
    completion = delta.completion_tokens if delta else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
