"""Request bodies in memory: ``limits.max_inflight_bytes`` on every route, and big
bodies spooled to a temporary file as they arrive.

A real server on loopback; the body that holds the budget is sent by hand on a
socket of its own, part of it, so that it is held for as long as the test
wants. The budget counts what arrived, so the test waits until the server has
it: its spooled file is seen where the server has it open
(``/proc/<pid>/fd``, in a ``$TMPDIR`` of the test's own), and holds more than
1 MiB; nothing is timed. A write of a spooled body cancelled under its
thread is ordered by hand, in a server in the test's own process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import HANDLERS, ServerProcess, spec, start_server, write_config
from inprocess import in_process
from stall_watch import watch_loop

import aserve.frontends.http.multipart as multipart
from aserve.errors import AserveError
from aserve.frontends.http.bodies import SpooledBody

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
MAX_BODY = 2 * MiB
INFLIGHT = 3 * MiB
BOUNDARY = "inflightB0und"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def raw_model() -> dict[str, Any]:
    return {
        "name": "raw", "engine": "python", "handler": "raw_body:RawBody",
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [spec("LENGTH", "INT64", [1]), spec("BATCH", "INT64", [1])],
        "batching": {"max_batch_size": 8, "max_delay_ms": 0},
    }  # fmt: skip


def serve(folder: Path, limits: dict[str, Any]) -> ServerProcess:
    shutil.copy(HANDLERS / "raw_body.py", folder / "raw_body.py")
    spool = folder / "tmpdir"
    spool.mkdir()
    config = write_config(folder, {"limits": limits, "models": [raw_model()]})
    return start_server(config, extra_env={"TMPDIR": str(spool)})


def tmpdir_of(srv: ServerProcess) -> Path:
    """The ``$TMPDIR`` :func:`serve` gave the server (beside its config)."""
    return Path(srv.log_text().split("starting with ", 1)[1].split()[0]).parent / "tmpdir"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = serve(
        tmp_path_factory.mktemp("inflight"),
        {"max_request_bytes": MAX_BODY, "max_inflight_bytes": INFLIGHT},
    )
    yield srv
    srv.stop()


def part(name: str, data: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return (
        (
            f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + b"\r\n"
    )


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


async def half_sent(
    port: int, path: str, body: bytes, content_type: str, sent: int, extra: str = ""
) -> Any:
    """A request whose first ``sent`` bytes of ``body`` are on their way; the rest
    waits on the returned writer. ``extra``: more header lines, each ending in CRLF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:sent]
    )
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers["content-length"]))


def v2_text(size: int) -> bytes:
    """A V2 infer body of exactly ``size`` bytes."""
    doc = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}
    padding = size - len(orjson.dumps(doc)) - len(b',"id":""')
    doc["id"] = "p" * padding
    body = orjson.dumps(doc)
    assert len(body) == size
    return body


def multipart_of(size: int) -> bytes:
    """A multipart body of exactly ``size`` bytes: one file part."""
    body = form(part("f", b"z" * (size - len(form(part("f", b"", "z.bin")))), "z.bin"))
    assert len(body) == size
    return body


async def held_body(srv: ServerProcess, sent: int) -> tuple[Any, Any, bytes]:
    """A body of ``MAX_BODY`` to ``/predictions/raw`` of which ``sent`` bytes (over
    1 MiB) are sent, and more than 1 MiB of them arrived: the server has spooled
    them to a file that big. Its reader, its writer and the whole body."""
    big = os.urandom(MAX_BODY)
    reader, writer = await half_sent(
        srv.port, "/predictions/raw", big, "application/octet-stream", sent
    )
    for _ in range(1500):  # poll for the server's reads; the bound is a watchdog
        if any(size > MiB for size in _spooled_sizes(srv.proc.pid, tmpdir_of(srv))):
            return reader, writer, big
        await asyncio.sleep(0.02)
    writer.close()
    raise AssertionError("the held body never reached its spool file")


def held_by_others(error: str) -> int:
    return int(error.split("the server holds ", 1)[1].split()[0])


async def test_bodies_held_at_once_are_bounded_on_every_route(
    small_server: ServerProcess,
) -> None:
    """A body holds what of it arrived: another that would take the total over the
    limit is refused when its bytes would, on every route, chunked or not."""
    base, port = small_server.base, small_server.port
    sent = 5 * MiB // 4
    reader, writer, big = await held_body(small_server, sent)
    try:
        async with aiohttp.ClientSession() as session:
            # Over 1 MiB of the 3 MiB is held: 2 MiB more does not fit, on any route.
            json_headers = {"Content-Type": "application/json"}
            async with session.post(
                base + "/v2/models/raw/infer", data=v2_text(MAX_BODY), headers=json_headers
            ) as r:
                assert r.status == 429, await r.text()
                assert r.headers["Retry-After"] == "1"
                error = (await r.json())["error"]
            assert "limits.max_inflight_bytes is 3145728" in error, error
            assert MiB < held_by_others(error) <= sent, error
            async with session.post(
                base + "/predictions/raw",
                data=multipart_of(MAX_BODY),
                headers={"Content-Type": MULTIPART},
            ) as r:
                assert r.status == 429 and "max_inflight_bytes" in (await r.json())["error"]
            # A chunked body likewise, once what arrived does not fit.
            creader, cwriter = await asyncio.open_connection("127.0.0.1", port)
            cwriter.write(
                b"POST /v2/models/raw/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b" " * (256 * 1024)
            for _ in range(MAX_BODY // len(chunk)):
                cwriter.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await cwriter.drain()
            status, cheaders, answer = await asyncio.wait_for(answer_of(creader), 30)
            assert status == 429 and cheaders["retry-after"] == "1", answer
            assert b"max_inflight_bytes" in answer
            cwriter.close()
            # Small bodies still fit beside the held one.
            doc = {
                "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["ok"]}]
            }
            async with session.post(base + "/v2/models/raw/infer", json=doc) as r:
                assert r.status == 200, await r.text()
            async with session.get(base + "/metrics") as r:
                text = await r.text()
            refused = [
                line
                for line in text.splitlines()
                if line.startswith("aserve_rejected_requests_total")
                and 'reason="max_inflight_bytes"' in line
            ]
            assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 3.0, refused
            # The held body ends, is answered, and lets go of its bytes: a body of
            # the largest size fits again.
            writer.write(big[sent:])
            await writer.drain()
            status, _, answer = await asyncio.wait_for(answer_of(reader), 30)
            assert status == 200 and orjson.loads(answer)["length"] == MAX_BODY
            writer.close()
            async with session.post(
                base + "/v2/models/raw/infer", data=v2_text(MAX_BODY), headers=json_headers
            ) as r:
                assert r.status == 200, await r.text()
    finally:
        writer.close()


async def test_a_declared_length_holds_nothing(small_server: ServerProcess) -> None:
    """Sockets that declare the largest body and send nothing hold none of the
    budget (they held it all, for http.body_timeout_s, when the declared length
    was charged first); one over max_request_bytes is still refused before its
    body is read."""
    port = small_server.port
    head = (
        "POST /predictions/raw HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n"
    )
    # This one is being read (its bytes are in its spool file), so its declared
    # length would be held by now if declared lengths were charged.
    sent = 5 * MiB // 4
    reader, writer, big = await held_body(small_server, sent)
    idle = []
    for _ in range(4):
        idle.append(await asyncio.open_connection("127.0.0.1", port))
        idle[-1][1].write(head.format(MAX_BODY).encode())
        await idle[-1][1].drain()
    try:
        async with aiohttp.ClientSession() as session:
            # Under 1.25 MiB held: 1.5 MiB fits (2 MiB declared and 1.5 would not).
            async with session.post(
                small_server.base + "/v2/models/raw/infer",
                data=v2_text(3 * MiB // 2),
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 200, await r.text()
        # Over max_request_bytes: 413 from the head alone.
        oreader, owriter = await asyncio.open_connection("127.0.0.1", port)
        owriter.write(head.format(MAX_BODY + 1).encode())
        await owriter.drain()
        status, _, answer = await asyncio.wait_for(answer_of(oreader), 30)
        owriter.close()
        assert status == 413 and b"over the limit max_request_bytes 2097152" in answer, answer
        writer.write(big[sent:])
        await writer.drain()
        status, _, answer = await asyncio.wait_for(answer_of(reader), 30)
        assert status == 200 and orjson.loads(answer)["length"] == MAX_BODY, answer
        # The idle sockets were never refused: each sends its body now, one after
        # another, and is answered 200.
        for ireader, iwriter in idle:
            iwriter.write(big)
            await iwriter.drain()
            status, _, answer = await asyncio.wait_for(answer_of(ireader), 30)
            assert status == 200 and orjson.loads(answer)["length"] == MAX_BODY, answer
    finally:
        writer.close()
        for _, iwriter in idle:
            iwriter.close()


def _spooled_files(pid: int, folder: Path) -> list[str]:
    """The files under ``folder`` that process ``pid`` has open (an unnamed
    O_TMPFILE shows as ``folder/#inode (deleted)``)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def _spooled_sizes(pid: int, folder: Path) -> list[int]:
    """The sizes of the files :func:`_spooled_files` finds."""
    sizes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(folder)):
                sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
        except OSError:  # closed meanwhile
            continue
    return sizes


def _big_request(route: str) -> tuple[str, bytes, str, str, Any]:
    """(path, body, content type, extra headers, what the answer must say) of a body
    of 1.5 MiB and more to ``route``."""
    if route == "v2":  # one BYTES element, in the binary tensor extension
        data = os.urandom(3 * MiB // 2)
        header = orjson.dumps(
            {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                         "parameters": {"binary_data_size": 4 + len(data)}}]}
        )  # fmt: skip
        body = header + len(data).to_bytes(4, "little") + data
        extra = f"Inference-Header-Content-Length: {len(header)}\r\n"

        def check(answer: bytes) -> None:
            outputs = {o["name"]: o["data"] for o in orjson.loads(answer)["outputs"]}
            assert outputs["LENGTH"] == [len(data)]

        return "/v2/models/raw/infer", body, "application/octet-stream", extra, check
    parts = [os.urandom(MiB), b"small", os.urandom(MiB // 2)]
    body = form(part("a", parts[0], "a.bin"), part("b", parts[1]), part("c", parts[2], "c.bin"))

    def check_parts(answer: bytes) -> None:
        got = [(p["name"], p["length"], p["sha256"]) for p in orjson.loads(answer)["parts"]]
        assert got == [
            (name, len(d), hashlib.sha256(d).hexdigest())
            for name, d in zip("abc", parts, strict=True)
        ]

    return "/predictions/raw", body, MULTIPART, "", check_parts


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/<pid>/fd")
@pytest.mark.parametrize("route", ["predictions", "v2"])
async def test_a_big_body_lands_in_a_temporary_file_gone_after(
    small_server: ServerProcess, route: str
) -> None:
    """A multipart body to /predictions is split from its file; a V2 body is read back
    whole from it. Either way the file is closed before the handler runs."""
    tmpdir = tmpdir_of(small_server)
    pid = small_server.proc.pid
    path, body, content_type, extra, check = _big_request(route)
    sent = 5 * MiB // 4
    reader, writer = await half_sent(small_server.port, path, body, content_type, sent, extra)
    try:
        for _ in range(500):  # the server writes what it has to the file: poll for it
            if _spooled_files(pid, tmpdir):
                break
            await asyncio.sleep(0.02)
        assert _spooled_files(pid, tmpdir), "the body never went to a file in $TMPDIR"
        writer.write(body[sent:])
        await writer.drain()
        status, _, answer = await asyncio.wait_for(answer_of(reader), 30)
    finally:
        writer.close()
    assert status == 200, answer
    check(answer)
    # Closed once the body was read back, before the handler ran; nothing on disk.
    assert _spooled_files(pid, tmpdir) == []
    assert list(tmpdir.iterdir()) == []


@pytest.fixture(scope="module")
def roomy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = serve(tmp_path_factory.mktemp("roomy"), {"max_request_bytes": 16 * MiB})
    yield srv
    srv.stop()


async def test_big_multipart_bodies_at_once_do_not_stall_the_loop(
    roomy_server: ServerProcess,
) -> None:
    """Four 12 MiB uploads at once (the default budget, 64 MiB, takes them all), each
    answered with its parts' digests, while the liveness probes keep their bound."""
    files = [os.urandom(12 * MiB) for _ in range(4)]
    url = roomy_server.base + "/predictions/raw"

    async def upload(session: aiohttp.ClientSession, data: bytes) -> list[Any]:
        body = form(part("file", data, "big.bin"), part("note", b"hello"))
        async with session.post(url, data=body, headers={"Content-Type": MULTIPART}) as r:
            assert r.status == 200, await r.text()
            return [(p["length"], p["sha256"]) for p in (await r.json())["parts"]]

    async with watch_loop(roomy_server.base):
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(upload(session, data) for data in files))
    for data, got in zip(files, answers, strict=True):
        assert got == [
            (len(data), hashlib.sha256(data).hexdigest()),
            (5, hashlib.sha256(b"hello").hexdigest()),
        ]


async def test_a_write_cancelled_under_its_thread_never_lands_in_another_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client goes while a thread writes its body to the spool file: the request
    ends at once, cancelled, but the file stays open until the write has returned,
    so files the process opens meanwhile never get that body's bytes (closing it
    under the writer gave its descriptor number to the next file opened, and the
    write landed there). The write is held on an event the test sets."""
    mark = b"\xab"  # every byte of the cancelled body
    real_writev = os.writev
    entered, go, returned = threading.Event(), threading.Event(), threading.Event()
    spool: dict[str, int] = {}

    def held_writev(fd: int, buffers: Any) -> int:
        if spool or not buffers or bytes(buffers[0][:1]) != mark:
            return real_writev(fd, buffers)
        stat = os.fstat(fd)
        spool.update(fd=fd, dev=stat.st_dev, ino=stat.st_ino)
        entered.set()
        go.wait(60)
        try:
            return real_writev(fd, buffers)
        finally:
            returned.set()

    def spool_is_open() -> bool:
        try:
            stat = os.fstat(spool["fd"])
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == (spool["dev"], spool["ino"])

    monkeypatch.setattr(os, "writev", held_writev)
    shutil.copy(HANDLERS / "raw_body.py", tmp_path / "raw_body.py")
    opened: list[int] = []
    async with in_process({"models": [raw_model()]}, tmp_path) as srv:
        _reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        try:
            writer.write(
                b"POST /predictions/raw HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n"
                % (4 * MiB)
                + mark * (3 * MiB // 2)
            )
            await writer.drain()
            assert await asyncio.to_thread(entered.wait, 60), "the body was never written"
            handlers = [
                t
                for t in asyncio.all_tasks()
                if t.get_coro().__qualname__.endswith("._handle_request")
            ]
            assert len(handlers) == 1, handlers
            writer.close()  # the client goes: aiohttp cancels the handler
            done, _ = await asyncio.wait(handlers, timeout=60)
            # Ended, cancelled, while its write is still held on its thread.
            assert done and handlers[0].cancelled() and not returned.is_set()
            open_while_writing = spool_is_open()
            # Files opened now: enough to take the spool's number, were it free.
            for i in range(spool["fd"] + 1):
                opened.append(os.open(tmp_path / f"other{i}", os.O_CREAT | os.O_RDWR))
            go.set()
            assert await asyncio.to_thread(returned.wait, 60)
            for _ in range(3000):  # the writer's thread closes it on its way out
                if not spool_is_open():
                    break
                await asyncio.sleep(0.01)
            landed = {
                i: os.fstat(fd).st_size for i, fd in enumerate(opened) if os.fstat(fd).st_size
            }
            assert landed == {}, f"the cancelled body's bytes landed in other files: {landed}"
            assert open_while_writing, "the spool file was closed under its writer"
            assert not spool_is_open(), "the spool file was never closed"
            # The server goes on.
            async with aiohttp.ClientSession() as session:
                async with session.post(srv.base + "/predictions/raw", data=b"x" * 100) as r:
                    assert r.status == 200, await r.text()
        finally:
            go.set()
            writer.close()
            for fd in opened:
                os.close(fd)


# --- the split itself, in memory and from a file --------------------------------------


CASES = [
    form(part("a", b"1"), part("b", b"\r\n--almost\r\n"), part("c", b"")),
    form(*(part(f"p{i}", os.urandom(i * 37), f"f{i}.bin") for i in range(20))),
    b"preamble\r\n" + form(part("a", b"x" * 5000)),
    form(part("a", b"x"))[:-10],  # cut short
    form(part("a", b"x")).replace(b"Content-Type", b"X-" + b"h" * 9000),  # a long header line
    f"--{BOUNDARY}\r\n".encode() + b"X-A: b\r\n" * 40 + b"\r\nx\r\n" + f"--{BOUNDARY}--".encode(),
    f"--{BOUNDARY}junk\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode(),
    form(*(part("p", b"x") for _ in range(129))),
]


@pytest.mark.parametrize("body", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("window", [3, 64, 1 << 20])
def test_a_spooled_body_splits_as_one_in_memory(
    body: bytes, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same parts, or the same error, from bytes and from a file, whatever the
    window the search reads at a time."""
    monkeypatch.setattr(multipart, "_FIND_WINDOW_BYTES", window)

    def split(source: bytes | SpooledBody) -> Any:
        try:
            return [
                (p.name, p.filename, p.content_type, p.data)
                for p in multipart.split_parts(MULTIPART, source)
            ]
        except AserveError as exc:
            return type(exc).__name__, exc.message

    in_memory = split(body)
    file = tempfile.TemporaryFile(buffering=0)
    file.write(body)
    with SpooledBody(file, len(body)) as spooled:
        assert split(spooled) == in_memory
    assert file.closed
