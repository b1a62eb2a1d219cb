"""Two replicas behind HAProxy (bench/cluster.py with small numbers): a rolling
restart under load fails no request; a SIGKILL fails only what was in flight
on the replica and what HAProxy sent it before it saw the replica DOWN."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.cluster import haproxy_binary, run_scenarios

pytestmark = [
    pytest.mark.skipif(
        haproxy_binary() is None, reason="haproxy is not installed (.ci/run installs it)"
    ),
    pytest.mark.timeout(400),
]
CONCURRENCY = 8


def test_rolling_restart_fails_nothing_and_a_kill_fails_only_its_requests(tmp_path: Path) -> None:
    steady, rolling, kill = asyncio.run(
        run_scenarios(tmp_path, 2, CONCURRENCY, 0.5, ["rolling", "kill"])
    )
    assert steady.failed == 0 and steady.requests > 0, steady
    # Each replica in turn: DOWN in HAProxy before its listeners closed, exit 0, a new one UP.
    assert rolling.failed == 0, rolling
    assert rolling.notes["exit_codes"] == [0, 0], rolling
    assert rolling.requests > 0, rolling
    # SIGKILL: the requests in flight on it (one per connection at most) fail
    # (HAProxy answers 502); HAProxy answers 503 for those it routes there
    # until its checks mark it DOWN (connect refused, retries 0: none is
    # retried). Nothing fails after that, restart included.
    in_flight = kill.failed - kill.statuses.get(503, 0)
    assert set(kill.statuses) <= {502, 503}, kill
    assert in_flight <= CONCURRENCY, kill
    assert kill.failed == kill.notes["failed_until_down"], kill
