"""The one supervisor of the server's child processes: handshake, restart with
backoff, stop. Real child processes (tests/supervised_child.py), a recorded
sleep instead of the backoff's waits."""

from __future__ import annotations

import asyncio
import os
import select
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import supervised_child
import uvloop

from aserve.workers import supervisor
from aserve.workers.supervisor import RESTART_BACKOFF_S, Supervisor, restart_delay

pytestmark = pytest.mark.timeout(60)

BACKOFF = (0.25, 0.5, 1.5)
CHILD = "aserve-test-child"  # the process name of Owner's child


class ChildFailed(RuntimeError):
    pass


class Owner:
    """What an executor does with its supervisor's news, recorded."""

    def __init__(self, tmp_path: Path, plan: list[str], sleep: Any = None) -> None:
        self.attempts = tmp_path / "attempts"
        self.attempts.mkdir()
        self.messages: list[list[Any]] = []
        self.heard = asyncio.Event()
        self.lost: list[str] = []
        self.lives: list[bool] = []
        self.delays: list[float] = []
        self.changed = asyncio.Event()
        self.sup = Supervisor(
            supervised_child.main, (str(self.attempts), plan), "child 't'", CHILD,
            ChildFailed, self._message, self.lost.append, self._live,
            backoff=BACKOFF, sleep=sleep or self._sleep,
        )  # fmt: skip

    def send(self, msg: tuple[Any, ...]) -> None:
        assert self.sup.channel is not None
        self.sup.channel.send(msgpack.packb(msg))

    def _message(self, payload: bytes) -> None:
        msg = msgpack.unpackb(payload)
        if msg[0] == "fatal":  # an owner records it, for the exit reason
            self.sup.fatal = msg[1]
        self.messages.append(msg)
        self.heard.set()

    async def _sleep(self, seconds: float) -> None:
        self.delays.append(seconds)

    def _live(self) -> None:
        self.lives.append(self.sup.up)
        self.changed.set()

    async def until(self, lives: int) -> None:
        while len(self.lives) < lives:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 30)

    def started(self) -> int:
        return len(list(self.attempts.iterdir()))

    async def echo(self, text: str) -> list[Any]:
        self.heard.clear()
        self.send(("echo", text))
        await asyncio.wait_for(self.heard.wait(), 30)
        return self.messages[-1]


def test_the_default_backoff_grows_to_ten_seconds_and_stays() -> None:
    assert [restart_delay(i) for i in range(7)] == [0.5, 1.0, 2.0, 5.0, 10.0, 10.0, 10.0]
    assert RESTART_BACKOFF_S[-1] == 10.0
    assert [restart_delay(i, BACKOFF) for i in range(4)] == [0.25, 0.5, 1.5, 1.5]


async def test_a_child_that_dies_is_restarted_backing_off_between_failed_starts(
    tmp_path: Path,
) -> None:
    o = Owner(tmp_path, ["ok", "load_error", "load_error", "ok", "load_error", "ok"])
    await o.sup.start()
    try:
        assert o.sup.up and o.sup.pid is not None and o.messages == [["ready", 0]]
        assert await o.echo("a") == ["echo", 0, "a"]
        first = o.sup.pid

        o.send(("die",))
        await o.until(2)
        assert o.lives == [False, True]  # down at once, up once a start succeeded
        assert o.lost == ["the child 't' exited (exit code 3)"]  # told after it was reaped
        assert o.delays == [0.25, 0.5]  # one wait per failed start, each longer
        assert o.started() == 4 and o.sup.restarts == 1
        assert o.sup.pid not in (None, first)
        assert await o.echo("b") == ["echo", 3, "b"]

        o.send(("die",))  # a new death starts the backoff over
        await o.until(4)
        assert o.lives == [False, True, False, True]
        assert o.delays == [0.25, 0.5, 0.25]
        assert o.started() == 6 and o.sup.restarts == 2
        assert await o.echo("c") == ["echo", 5, "c"]
    finally:
        await o.sup.stop()
    assert not o.sup.up and o.sup.pid is None


async def test_a_failed_first_start_raises_the_load_error_and_is_not_retried(
    tmp_path: Path,
) -> None:
    o = Owner(tmp_path, ["load_error", "ok"])
    with pytest.raises(ChildFailed, match=r"cannot load \(attempt 0\)"):
        await o.sup.start()
    assert not o.sup.up and o.started() == 1 and o.lives == [] and o.lost == []
    await o.sup.stop()
    assert o.started() == 1


async def test_a_child_that_exits_before_its_handshake_fails_its_start(tmp_path: Path) -> None:
    o = Owner(tmp_path, ["exit"])
    with pytest.raises(ChildFailed, match="the child 't' exited"):
        await o.sup.start()
    assert not o.sup.up and o.lives == []


async def test_what_a_dying_child_said_is_in_the_reason(tmp_path: Path) -> None:
    o = Owner(tmp_path, ["ok"])
    await o.sup.start()
    try:
        o.send(("fatal",))
        await o.until(2)
        assert o.lost == ["the child 't' exited (exit code 4): SystemExit: bye"]
        assert o.delays == []  # the first restart worked: no wait
    finally:
        await o.sup.stop()


async def test_stop_cuts_a_restart_short_and_still_reports_what_was_lost(
    tmp_path: Path,
) -> None:
    waiting = asyncio.Event()

    async def held(seconds: float) -> None:
        o.delays.append(seconds)
        waiting.set()
        await asyncio.Event().wait()  # until cancelled

    o = Owner(tmp_path, ["ok", "load_error"], sleep=held)
    await o.sup.start()
    o.send(("die",))
    await asyncio.wait_for(waiting.wait(), 30)  # the first restart failed; backing off
    assert o.lives == [False] and o.lost == ["the child 't' exited (exit code 3)"]
    await asyncio.wait_for(o.sup.stop(), 30)
    assert o.started() == 2 and o.delays == [0.25] and o.sup.restarts == 0
    assert not o.sup.up and o.lives == [False] and len(o.lost) == 1


async def test_stop_reads_the_answer_a_child_wrote_before_it_exited(tmp_path: Path) -> None:
    o = Owner(tmp_path, ["ok"])
    await o.sup.start()
    o.send(("echo", "last"))
    await o.sup.stop()
    assert o.messages[-1] == ["echo", 0, "last"] and o.lives == []


@pytest.mark.parametrize(
    "loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_child_ready_before_its_pipe_is_watched_still_hands_the_stream_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop_factory: Any
) -> None:
    """The loop is held (as another model's ``import torch`` on the loop held it)
    from just after the spawn until the child's ``ready`` is in the pipe: the
    handshake and the first answer after it arrive in the first read, before the
    start resumes. Every message after ``ready`` must still reach the owner (one
    was dropped as "sent 'echo' before it was ready", and its batch never answered)."""
    real_start = supervisor.start

    def start_then_hold(*args: Any) -> Any:
        proc, parent = real_start(*args)
        fd = os.dup(parent.fileno())

        def hold() -> None:  # runs on the loop, before the pipe's first read
            try:
                readable, _, _ = select.select([fd], [], [], 30)
                assert readable, "the child never said ready"
            finally:
                os.close(fd)

        asyncio.get_running_loop().call_soon(hold)
        return proc, parent

    monkeypatch.setattr(supervisor, "start", start_then_hold)

    async def scenario() -> None:
        o = Owner(tmp_path, ["ok"])
        await asyncio.wait_for(o.sup.start(), 30)
        try:
            o.send(("echo", "first"))
            o.send(("die",))  # the echo is written before the EOF, so read before it
            await o.until(1)
            assert o.messages == [["ready", 0], ["echo", 0, "first"]]
        finally:
            await o.sup.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(scenario())


async def test_a_child_started_early_is_taken_over_by_the_first_start(tmp_path: Path) -> None:
    o = Owner(tmp_path, ["ok"])
    early = supervisor.start_early(supervised_child.main, (str(o.attempts), ["ok"]), CHILD)
    assert early is not None
    await o.sup.start()
    try:
        assert o.sup.pid == early
        assert await o.echo("a") == ["echo", 0, "a"]
        assert o.started() == 1  # no second child
    finally:
        await o.sup.stop()


async def test_a_child_started_early_otherwise_is_stopped_and_replaced(tmp_path: Path) -> None:
    o = Owner(tmp_path, ["ok"])
    other = supervisor.start_early(supervised_child.main, (str(o.attempts), ["ok", "ok"]), CHILD)
    assert other is not None
    await o.sup.start()
    try:
        assert o.sup.pid not in (None, other)
        assert not psutil.pid_exists(other)  # killed and reaped
        assert (await o.echo("a"))[2] == "a"
    finally:
        await o.sup.stop()


def test_children_started_early_that_nobody_takes_are_stopped(tmp_path: Path) -> None:
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    args = (str(attempts), ["ok"])
    pid = supervisor.start_early(supervised_child.main, args, "aserve-test-unused")
    assert pid is not None
    # One child per name: a second is not started.
    assert supervisor.start_early(supervised_child.main, args, "aserve-test-unused") is None
    supervisor.stop_early()
    assert not psutil.pid_exists(pid)
