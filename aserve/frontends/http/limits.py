"""What an HTTP connection may hold, for the aiohttp frontend (frontends layer, on the loop).

aiohttp accepts every connection and, left alone, keeps one that never sends
a request for its whole keep-alive timeout. A socket costs an attacker
nothing, so :class:`ConnectionGuard` sorts connections in two kinds:

- *pending*: connected, no complete request head yet. Each has
  ``http.header_timeout_s`` to send one, then it is closed; at most
  ``limits.max_pending_connections`` (and no more than half the file
  descriptors left at start) are open at once, and a new one over that
  closes the one that has waited longest (clients that send their request at
  once are never the oldest for long; idle or trickling sockets are).
- *serving*: has sent a complete request head. Only these count against
  ``limits.max_connections``: a connection whose first request arrives while
  that many are serving gets that request answered 429 (``Retry-After: 1``)
  and is closed. Answering rather than closing at once lets the client read
  why; closing frees the slot for a later connection.

An idle kept-alive connection is closed by aiohttp after
``http.keepalive_timeout_s``; the next request head on it must be complete by
then. Closing for either timeout is logged as one throttled line.

A connection that sends refused requests one after another (429/503: a
client that retries the moment it is refused) has its refusals *paced*
(:meth:`ConnectionGuard.refusal_hold`): the first in a row is answered at
once, each further one only after a hold that doubles from
``PACE_FIRST_S``, up to ``PACE_BUDGET_SHARE`` of the request's own budget
(``PACE_MAX_S`` at most). Such a client's retries then cost the server one
refusal per hold, not one per loop pass: answered at once, 256 of them kept
the loop busy with ~4,000 refusals a second, which starved the model, the
admitted requests and the health probes (bench/RESULTS-overload.md, "Retry
storm"). A run starts only while the loop lags (its recent lag at least
``PACE_LAG_S``): a loop that keeps up pays for its refusals easily, and an
open-loop client, whose pool reuses the connection it was just refused on,
gets its refusal at once. Once started, a run goes on whatever the lag: the
pacing is what let the loop catch up, and a run dropped then let the same
clients flood it again within a few passes (the lag-gated pace swung
between the two; bench/RESULTS-overload.md). The hold is a timer: no CPU,
no admission slot, no queue slot; the refusal was decided on arrival, and
the next request on the connection, sent after the answer, has its whole
budget. A refusal long after the last one's answer (``PACE_RESET_S``)
starts a new run; any other answer on the connection halves the run. HTTP
only: gRPC's own clients back off on RESOURCE_EXHAUSTED / UNAVAILABLE.

Running out of file descriptors is logged too, once per burst: an event loop
that refuses an accept with EMFILE is seen by :func:`accept_error_handler`;
uvloop (libuv) hides it, so :class:`ConnectionGuard` warns when the open
connections near the process's ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from aserve.loop.loop_lag import LoopLag
from aserve.obs.log_throttle import Throttled

log = logging.getLogger("aserve.http")

_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_FD_WARN_FRACTION = 0.9  # of RLIMIT_NOFILE: warn before the OS starts refusing
PACE_FIRST_S = 0.02  # the hold of a connection's second refusal in a row; it doubles
PACE_MAX_S = 0.5  # and never exceeds this,
PACE_BUDGET_SHARE = 0.75  # nor this share of the refused request's deadline budget
# A refusal this long after the last one's answer was not a retry at once: a new run.
PACE_RESET_S = PACE_MAX_S
# Pacing only while the loop runs its callbacks this late: refusals are costing it.
PACE_LAG_S = 0.010
REFUSED_STATUSES = (429, 503)


def refusal_hold_s(in_a_row: int, budget_s: float | None) -> float:
    """How long to hold, before answering it, a connection's ``in_a_row``-th refusal
    in a row (1: the first), of a request whose deadline budget is ``budget_s``
    (None: unknown). Under the budget, so that a client that waits for its
    answer until its deadline still gets the refusal, not a timeout; the rest
    of the budget is room for the loop's own lag."""
    if in_a_row < 2:
        return 0.0
    cap = PACE_MAX_S if budget_s is None else min(PACE_MAX_S, PACE_BUDGET_SHARE * budget_s)
    return min(PACE_FIRST_S * 2.0 ** min(in_a_row - 2, 30), cap)


class ConnectionGuard:
    """Header timeout, the pending bound and ``max_connections`` on one aiohttp server.

    Call :meth:`install` after ``AppRunner.setup()`` and before the site
    starts. A connection's first request goes through the guard (it moves the
    connection from pending to serving); then the connection is handed back to
    aiohttp's handler (``RequestHandler._request_handler``, read per request).
    """

    def __init__(
        self,
        *,
        header_timeout_s: float,
        max_pending: int,
        max_serving: int | None,
        rejected: dict[str, int],
        fd_limit: int | None,
        fds_in_use: int,
        clock: Callable[[], float] = time.monotonic,
        loop_lag: Callable[[], float] | None = None,
    ) -> None:
        self._header_timeout_s = header_timeout_s
        self._max_pending = max_pending
        self._max_serving = max_serving
        self._rejected = rejected
        # Oldest first (dicts keep insertion order): the eviction order.
        self._pending: dict[RequestHandler, asyncio.TimerHandle] = {}
        self._serving: set[RequestHandler] = set()
        # Connections with a run of refusals: [how many in a row, when the last one's
        # answer went out]. The app looks a served request's connection up here (a
        # dict lookup, no frame) and calls served() only when it is in.
        self.refused_in_a_row: dict[Any, list[float]] = {}
        self._clock = clock
        self._loop_lag = loop_lag  # the loop's recent lag, seconds (set by install)
        self._fd_limit = fd_limit
        self._fd_warn_at = None if fd_limit is None else int(fd_limit * _FD_WARN_FRACTION)
        self._fds_in_use = fds_in_use  # at start: models, pipes, listeners
        self._open = 0
        self._closed_log = Throttled(log, logging.INFO)
        self._fd_log = Throttled(log, logging.WARNING)
        self._paced_log = Throttled(log, logging.INFO)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def serving(self) -> int:
        return len(self._serving)

    def install(self, server: Server) -> None:
        connection_made, connection_lost = server.connection_made, server.connection_lost
        handle = server.request_handler
        loop = asyncio.get_running_loop()
        if self._loop_lag is None:
            lag = LoopLag.of_running_loop()
            self._loop_lag = lambda: lag.recent

        def made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            connection_made(handler, transport)
            # Only the connection's first request passes through first_request;
            # it hands the connection back to aiohttp's own handler, so later
            # requests on it gain no frame here.
            handler._request_handler = first_request
            self._open += 1
            self._pending[handler] = loop.call_later(
                self._header_timeout_s, self._header_timeout, handler
            )
            if len(self._pending) > self._max_pending:
                oldest = next(iter(self._pending))
                self._close_pending(oldest, "max_pending_connections")
            self._check_fds()

        def lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            timer = self._pending.pop(handler, None)
            if timer is not None:
                timer.cancel()
            self._serving.discard(handler)
            self.refused_in_a_row.pop(handler, None)
            self._open -= 1
            connection_lost(handler, exc)

        # Not a coroutine itself: the handler's own awaitable is passed on.
        def first_request(request: Any) -> Awaitable[web.StreamResponse]:
            protocol = request.protocol
            protocol._request_handler = handle  # aiohttp reads it for each request
            timer = self._pending.pop(protocol, None)
            if timer is not None:
                timer.cancel()
                limit = self._max_serving
                if limit is not None and len(self._serving) >= limit:
                    return self._refuse(limit)
                self._serving.add(protocol)
            return handle(request)

        server.connection_made = made  # type: ignore[method-assign]
        server.connection_lost = lost  # type: ignore[method-assign]

    def refusal_hold(self, handler: Any, budget_s: float | None) -> float:
        """Count a refusal on ``handler``'s connection; how long to hold its answer."""
        lag = 0.0 if self._loop_lag is None else self._loop_lag()
        run = self.refused_in_a_row.get(handler)
        if run is None and lag < PACE_LAG_S:
            # The loop keeps up: refusing at once is cheap enough, and a run counted
            # now would hold an open-loop client's later refusals. A run already
            # counted goes on (its pacing is why the loop keeps up).
            return 0.0
        now = self._clock()
        if run is None:
            run = self.refused_in_a_row[handler] = [0, now]
        elif now - run[1] >= PACE_RESET_S:
            # The client waited before it asked again: not a storm's retry.
            if lag < PACE_LAG_S:  # and the loop keeps up: the run is over
                del self.refused_in_a_row[handler]
                return 0.0
            run[0] = 0
        run[0] += 1
        hold = refusal_hold_s(int(run[0]), budget_s)
        run[1] = now + hold
        if hold:
            self._paced_log.event(
                "an HTTP connection sends refused requests one after another: its "
                "refusals are answered after a hold (now %.0f ms, after %d in a row; "
                "the event loop's lag %.0f ms)",
                hold * 1e3,
                run[0],
                lag * 1e3,
            )
        return hold

    def served(self, handler: Any) -> None:
        """Something other than a refusal was answered on ``handler``'s connection,
        which had a run of refusals: it counts half as many. A client served once
        between refusals (a storm's) goes on nearly where it was; one that is
        served again and again is soon answered at once again."""
        run = self.refused_in_a_row.get(handler)
        if run is None:
            return
        run[0] = run[0] // 2
        if not run[0]:
            del self.refused_in_a_row[handler]

    def _header_timeout(self, handler: RequestHandler) -> None:
        if handler in self._pending:
            self._close_pending(handler, "header_timeout")

    def _close_pending(self, handler: RequestHandler, reason: str) -> None:
        self._pending.pop(handler).cancel()
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        handler.force_close()  # connection_lost follows and forgets it
        if reason == "header_timeout":
            self._closed_log.event(
                "closed an HTTP connection that sent no complete request head within "
                "http.header_timeout_s %g s",
                self._header_timeout_s,
            )
        else:
            self._closed_log.event(
                "closed the oldest of %d HTTP connections without a complete request head "
                "(limits.max_pending_connections)",
                self._max_pending + 1,
            )

    async def _refuse(self, limit: int) -> web.Response:
        self._rejected["max_connections"] = self._rejected.get("max_connections", 0) + 1
        response = web.Response(
            status=429,
            body=orjson.dumps({"error": (
                f"server has {len(self._serving)} HTTP connections serving requests, its "
                f"limit limits.max_connections is {limit}; retry later"
            )}),
            content_type="application/json",
            headers={"Retry-After": "1"},
        )  # fmt: skip
        response.force_close()  # the slot goes back once this connection closes
        return response

    def _check_fds(self) -> None:
        if self._fd_warn_at is not None and self._fds_in_use + self._open >= self._fd_warn_at:
            self._fd_log.event(
                "%d HTTP connections open, near the open file limit (RLIMIT_NOFILE %d): "
                "past it new connections are reset by the OS; set limits.max_connections "
                "or raise the limit",
                self._open,
                self._fd_limit,
            )


def pending_bound(configured: int, fd_limit: int | None, fds_in_use: int) -> int:
    """``limits.max_pending_connections``, but at most half the descriptors
    left at start: sockets that never send a request can then not exhaust them."""
    if fd_limit is None:
        return configured
    half = max(16, (fd_limit - fds_in_use) // 2)
    if half >= configured:
        return configured
    log.info(
        "limits.max_pending_connections %d lowered to %d: half the open file limit "
        "(RLIMIT_NOFILE %d) left at start",
        configured, half, fd_limit,
    )  # fmt: skip
    return half


def accept_error_handler(previous: Any) -> Any:
    """A loop exception handler that logs running out of file descriptors on
    accept as one throttled line; everything else goes to ``previous`` (the
    loop's default handler when None)."""
    throttled = Throttled(log, logging.WARNING)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _FD_ERRNOS:
            throttled.event(
                "cannot accept a connection: %s; new connections wait or are refused until "
                "descriptors are freed (raise RLIMIT_NOFILE or set limits.max_connections)",
                exc.strerror,
            )
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    return handle
