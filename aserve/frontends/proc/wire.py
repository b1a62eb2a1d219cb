"""What crosses between a frontend process and the core (frontends layer, both sides).

A frontend forwards each request to the core's app over the private Unix
socket with the client's headers as given, less the hop-by-hop ones, plus
two of its own, which the core trusts on that socket only (a client's own
copies are dropped by the frontend before it adds them):

- :data:`ARRIVAL_HEADER`: when the request's first bytes reached the
  frontend, ``time.monotonic()`` in seconds (CLOCK_MONOTONIC: one clock for
  every process of the machine), so that its deadline counts from there;
- :data:`FORWARDED_FOR_HEADER`: the client's address, for the logs.

Every answer the frontend sends carries :data:`FRONTEND_HEADER`, the pid of
the frontend process that served it.
"""

from __future__ import annotations

from typing import Final

ARRIVAL_HEADER: Final = "aserve-arrival"
FORWARDED_FOR_HEADER: Final = "aserve-forwarded-for"
FRONTEND_HEADER: Final = "aserve-frontend"
# The core's app in a private folder: only processes of this server's user reach it.
CORE_SOCKET_NAME: Final = "core.sock"
# The frontend's first line on its control socket once it is listening.
READY_LINE: Final = b"ready\n"
# The core's line to a frontend: stop accepting, answer what you hold, exit.
DRAIN_LINE: Final = b"drain\n"
# The core's first line to a frontend started with API keys configured: this prefix,
# then the keys it loaded by role (JSON), never written to a file.
KEYS_PREFIX: Final = b"keys "
# A frontend's line to the core, when they changed: this prefix, then a JSON object of
# its refusals by reason since it started (limits.max_connections, ...), for /metrics.
COUNTS_PREFIX: Final = b"counts "
# How often a frontend looks whether its counts changed.
COUNTS_INTERVAL_S: Final = 1.0

# Headers of one connection (RFC 9110, section 7.6.1), not the request's: never forwarded.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",  # the frontend's server answered any 100-continue itself
    }
)
# Not forwarded either: the frontend's own to set (above).
OWN: Final = frozenset({ARRIVAL_HEADER, FORWARDED_FOR_HEADER, FRONTEND_HEADER})
