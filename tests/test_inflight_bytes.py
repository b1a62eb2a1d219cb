"""Request bodies in memory: ``limits.max_inflight_bytes`` on every route, and big
bodies spooled to a temporary file as they arrive.

A real server on loopback; the body that holds the budget is sent by hand on a
socket of its own, half of it, so that it is held for as long as the test
wants; the refusals it causes are polled for, never timed. The spooled file is
seen where the server has it open (``/proc/<pid>/fd``), in a ``$TMPDIR`` of the
test's own.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import HANDLERS, ServerProcess, spec, start_server, write_config
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
    doc = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}
    padding = size - len(orjson.dumps(doc)) - 12
    doc["id"] = "p" * padding
    return orjson.dumps(doc)


async def refused_once_held(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[dict[str, str], str]:
    """Send until the server refuses (the held body's read may not have begun yet)."""
    for _ in range(200):
        async with session.post(url, data=body, headers=headers) as r:
            if r.status == 429:
                return dict(r.headers), (await r.json())["error"]
            assert r.status == 200, await r.text()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} was never refused while a body was held")


async def test_bodies_held_at_once_are_bounded_on_every_route(
    small_server: ServerProcess,
) -> None:
    base, port = small_server.base, small_server.port
    big = os.urandom(MAX_BODY)  # the most one request may send: 2 of the 3 MiB held
    reader, writer = await half_sent(
        port, "/predictions/raw", big, "application/octet-stream", 64 * 1024
    )
    try:
        async with aiohttp.ClientSession() as session:
            # 1.5 MiB more does not fit, on any route; refused before it is read.
            json_headers = {"Content-Type": "application/json"}
            headers, error = await refused_once_held(
                session, base + "/v2/models/raw/infer", v2_text(3 * MiB // 2), json_headers
            )
            assert headers["Retry-After"] == "1"
            assert "limits.max_inflight_bytes is 3145728" in error, error
            assert f"the server holds {MAX_BODY} bytes" in error, error
            body = form(part("f", b"z" * (3 * MiB // 2), "z.bin"))
            async with session.post(
                base + "/predictions/raw", data=body, headers={"Content-Type": MULTIPART}
            ) as r:
                assert r.status == 429 and "max_inflight_bytes" in (await r.json())["error"]
            # A chunked body has no length to refuse it by: it is refused once what
            # arrived does not fit.
            creader, cwriter = await asyncio.open_connection("127.0.0.1", port)
            cwriter.write(
                b"POST /v2/models/raw/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b" " * (256 * 1024)
            for _ in range(5):  # 1.25 MiB: over the 1 MiB left
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
            # The held body ends, is answered, and lets go of its bytes.
            writer.write(big[64 * 1024 :])
            await writer.drain()
            status, _, answer = await asyncio.wait_for(answer_of(reader), 30)
            assert status == 200 and orjson.loads(answer)["length"] == MAX_BODY
            writer.close()
            async with session.post(
                base + "/v2/models/raw/infer", data=v2_text(3 * MiB // 2), headers=json_headers
            ) as r:
                assert r.status == 200, await r.text()
    finally:
        writer.close()


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
    folder = Path(small_server.log_text().split("starting with ", 1)[1].split()[0]).parent
    tmpdir = folder / "tmpdir"
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
