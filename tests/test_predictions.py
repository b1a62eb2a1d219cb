"""POST /predictions/{model}: raw bodies and multipart files for a python handler, batched."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import mimetypes
import re
import shlex
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import HANDLERS, ServerProcess, model_entry, spec, start_server, write_config
from helpers import frozen, wait_for_stats
from stall_watch import watch_loop

pytestmark = pytest.mark.timeout(120)

MAX_BODY = 256 * 1024
MAX_CONCURRENCY = 6


@pytest.fixture(scope="module")
def raw_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("predictions")
    for name in ("raw_body", "sleeper"):
        shutil.copy(HANDLERS / f"{name}.py", folder / f"{name}.py")
    config = {
        "limits": {"max_request_bytes": MAX_BODY, "max_concurrency": MAX_CONCURRENCY},
        "models": [
            {
                "name": "raw", "engine": "python", "handler": "raw_body:RawBody",
                "executor": "process",  # helpers.frozen holds its batches
                "inputs": [spec("TEXT", "BYTES", [1])],
                "outputs": [spec("LENGTH", "INT64", [1]), spec("BATCH", "INT64", [1])],
                "batching": {"max_batch_size": 8, "max_delay_ms": 0, "timeout_ms": 60000},
            },
            {
                "name": "plain", "engine": "python", "handler": "sleeper:Sleeper",
                "parameters": {"sleep_ms": 0},
                "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
            },
            model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                        [spec("OUTPUT0", "FP32", [16])]),
        ],
    }  # fmt: skip
    srv = start_server(write_config(folder, config))
    yield srv
    srv.stop()


async def _post(
    session: aiohttp.ClientSession, url: str, data: Any, headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    async with session.post(url, data=data, headers=headers) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def _raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (as curl would); the status and body of its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return int(status_line.split()[1]), await reader.readexactly(length)
    finally:
        writer.close()


async def test_raw_bytes_like_curl_data_binary(raw_server: ServerProcess) -> None:
    image = bytes(range(256)) * 300  # 76800 bytes, every byte value
    head = (
        b"POST /predictions/raw?size=large HTTP/1.1\r\nHost: localhost\r\n"
        b"User-Agent: curl/8.5.0\r\nAccept: */*\r\nContent-Type: image/jpeg\r\n"
        b"Content-Length: %d\r\n\r\n" % len(image)
    )
    status, body = await _raw_http(raw_server.port, head, image)
    assert status == 200, body
    assert orjson.loads(body) == {
        "length": len(image),
        "sha256": hashlib.sha256(image).hexdigest(),
        "content_type": "image/jpeg",
        "parameters": {"size": "large"},
        "batch": 1,
    }


async def test_answers_in_the_handlers_content_type(raw_server: ServerProcess) -> None:
    url = raw_server.base + "/predictions/raw"
    async with aiohttp.ClientSession() as session:
        doc = {"text": "hello", "list": ["a", {"b": "c"}], "n": 3}
        status, ctype, body = await _post(
            session, url, orjson.dumps(doc), {"Content-Type": "application/json"}
        )
        assert (status, ctype) == (200, "application/json")
        assert orjson.loads(body) == {
            "echo": {"text": "HELLO", "list": ["A", {"b": "C"}], "n": 3},
            "batch": 1,
        }
        status, ctype, body = await _post(
            session, url + "/1", b"quiet words", {"Content-Type": "text/plain"}
        )
        assert (status, ctype, body) == (200, "text/plain; charset=utf-8", b"QUIET WORDS")
        status, ctype, body = await _post(
            session, url, b"\x00\x01\x02abc", {"Content-Type": "application/x-reverse"}
        )
        assert (status, ctype, body) == (200, "application/x-reversed", b"cba\x02\x01\x00")
        # A gzip body is inflated first, as on /infer.
        status, _, body = await _post(
            session, url, gzip.compress(b"z" * 1000),
            {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
        )  # fmt: skip
        assert status == 200 and orjson.loads(body)["length"] == 1000


async def test_multipart_files_are_one_request(raw_server: ServerProcess) -> None:
    files = [
        ("first", "cat.jpg", "image/jpeg", b"\xff\xd8cat" * 100),
        ("second", "dog.png", "image/png", b"\x89PNGdog\r\n--not-a-boundary" * 50),
        ("third", None, None, b"a plain form field"),
    ]
    form = aiohttp.FormData()
    for name, filename, ctype, data in files:
        if filename is None:
            form.add_field(name, data.decode())
        else:
            form.add_field(name, data, filename=filename, content_type=ctype)
    async with aiohttp.ClientSession() as session:
        status, _, body = await _post(session, raw_server.base + "/predictions/raw", form)
    assert status == 200, body
    doc = orjson.loads(body)
    assert doc["batch"] == 1
    assert [(p["name"], p["filename"], p["length"], p["sha256"]) for p in doc["parts"]] == [
        (name, filename, len(data), hashlib.sha256(data).hexdigest())
        for name, filename, _, data in files
    ]
    assert [p["content_type"] for p in doc["parts"]][:2] == ["image/jpeg", "image/png"]


async def test_concurrent_requests_batch_and_v2_still_serves(raw_server: ServerProcess) -> None:
    """Requests queued behind a busy instance run as one batch; the concurrency
    limit counts /predictions like /infer."""
    base = raw_server.base
    url = base + "/predictions/raw"
    async with aiohttp.ClientSession() as session:
        await wait_for_stats(session, base, "raw", lambda s: s["pending_request_count"] == 0)
        with frozen(raw_server.worker_pid("raw")):
            first = asyncio.create_task(_post(session, url, b"x"))
            await wait_for_stats(session, base, "raw", lambda s: s["running_batch_count"] == 1)
            queued = [asyncio.create_task(_post(session, url, b"y" * (i + 2))) for i in range(4)]
            v2 = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                              "data": ["abcdef"]}]}  # fmt: skip
            queued.append(asyncio.create_task(
                _post(session, base + "/v2/models/raw/infer", orjson.dumps(v2))
            ))  # fmt: skip
            await wait_for_stats(session, base, "raw", lambda s: s["pending_request_count"] == 5)
            # 6 in flight: one more is refused at once.
            status, _, body = await _post(session, url, b"z")
            assert status == 429, body
            assert f"limits.max_concurrency is {MAX_CONCURRENCY}" in orjson.loads(body)["error"]
        answers = [await t for t in (first, *queued)]
    assert [a[0] for a in answers] == [200] * 6, answers
    docs = [orjson.loads(a[2]) for a in answers]
    assert docs[0]["batch"] == 1
    assert [d["length"] for d in docs[1:5]] == [2, 3, 4, 5]
    assert [d["batch"] for d in docs[1:5]] == [5] * 4  # one batch, the V2 request in it
    out = {o["name"]: o["data"] for o in docs[5]["outputs"]}
    assert out == {"LENGTH": [6], "BATCH": [5]}


async def test_refusals_name_why(raw_server: ServerProcess) -> None:
    base = raw_server.base
    async with aiohttp.ClientSession() as session:
        status, _, body = await _post(session, base + "/predictions/nope", b"x")
        assert (status, orjson.loads(body)) == (
            404,
            {"error": "Request for unknown model: 'nope' is not found"},
        )
        status, _, body = await _post(session, base + "/predictions/raw/9", b"x")
        assert (
            status == 404
            and "Request for unknown model: 'raw' version 9 is not found"
            in orjson.loads(body)["error"]
        )
        status, _, body = await _post(session, base + "/predictions/affine", b"x")
        assert status == 400
        assert orjson.loads(body)["error"] == (
            "model 'affine' is served by the torch engine; /predictions hands the raw body "
            "to a python handler (engine 'python' with preprocess_raw): send tensors to "
            "/v2/models/affine/infer"
        )
        status, _, body = await _post(session, base + "/predictions/plain", b"x")
        assert status == 400
        assert (
            "handler sleeper:Sleeper has no preprocess_raw(request)"
            in (orjson.loads(body)["error"])
        )
        async with session.get(base + "/predictions/raw") as r:
            assert r.status == 405


async def test_body_limit_applies_before_the_body_is_read(raw_server: ServerProcess) -> None:
    port = raw_server.port
    async with watch_loop(raw_server.base):
        # A Content-Length over the limit is answered without sending the body.
        head = (
            b"POST /predictions/raw HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        status, body = await asyncio.wait_for(_raw_http(port, head), 30)
        assert status == 413
        assert orjson.loads(body)["error"] == (
            f"request body is 1000000000 bytes, over the limit max_request_bytes {MAX_BODY}"
        )
        async with aiohttp.ClientSession() as session:
            url = raw_server.base + "/predictions/raw"

            async def chunks() -> Any:  # chunked, no Content-Length: the read stops at the limit
                for _ in range(MAX_BODY // 8192 + 2):
                    yield b"c" * 8192

            status, _, body = await _post(session, url, chunks())
            assert status == 413 and "max_request_bytes" in orjson.loads(body)["error"]
            bomb = gzip.compress(b"\0" * (MAX_BODY + 1))
            status, _, body = await _post(session, url, bomb, {"Content-Encoding": "gzip"})
            assert status == 413
            assert "inflates to over the limit max_request_bytes" in orjson.loads(body)["error"]
            status, _, body = await _post(session, url, b"ok")
            assert status == 200


def _multipart(parts: list[bytes], boundary: str = "B0und") -> bytes:
    out = b"".join(f"--{boundary}\r\n".encode() + p + b"\r\n" for p in parts)
    return out + f"--{boundary}--\r\n".encode()


async def test_hostile_multipart_is_refused_without_stalling(raw_server: ServerProcess) -> None:
    port = raw_server.port
    ctype = "multipart/form-data; boundary=B0und"
    url = raw_server.base + "/predictions/raw"
    most_parts = _multipart([b"\r\n"] * 40_000)[: MAX_BODY - 100]  # ~6 bytes a part
    most_headers = _multipart([b"X-A: b\r\n" * 16 + b"\r\nx"] * 128)  # every bound, just
    cases: list[tuple[bytes, int, str]] = [
        (most_parts, 413, "over 128 parts"),
        (b"\n" * (MAX_BODY - 1000) + _multipart([b"\r\nx"]), 400, "before its first boundary"),
        (_multipart([b"X-A: b\r\n" * 30_000 + b"\r\nx"]), 400, "Too many headers"),
        (_multipart([b"X-A: " + b"b" * 9000 + b"\r\n\r\nx"]), 400, "cannot be read"),
        (_multipart([b"\r\nx"])[:-8], 400, "ends before its closing boundary"),
    ]
    async with watch_loop(raw_server.base) as watch:
        async with aiohttp.ClientSession() as session:
            for body, status, message in cases:
                got, _, answer = await _post(session, url, body, {"Content-Type": ctype})
                assert got == status and message in orjson.loads(answer)["error"], answer[:300]
            got, _, answer = await _post(session, url, most_headers, {"Content-Type": ctype})
            assert got == 200 and len(orjson.loads(answer)["parts"]) == 128
        # A Content-Length that promises more than comes, then the end of the stream:
        # the request fails alone (400, or the connection closes) and nothing waits on it.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = _multipart([b"\r\nx"])
        writer.write(
            b"POST /predictions/raw HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\n\r\n" % (ctype.encode(), len(body) + 5000) + body
        )
        await writer.drain()
        writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:300]
        writer.close()
        # One that promises less: the body is cut where it says; the rest is read as the
        # next request on the connection, which aiohttp's parser refuses (400) at once.
        status, answer = await _raw_http(
            port,
            b"POST /predictions/raw HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
            b"Content-Length: 20\r\n\r\n" % ctype.encode(),
            body,
        )
        assert status == 400, answer
    async with aiohttp.ClientSession() as session:
        assert (await _post(session, url, b"still here"))[0] == 200
    print(f"\nslowest liveness probe {watch.worst_s * 1e3:.1f} ms (bound {watch.bound_s:.2f} s)")


async def test_deadlines_apply_as_on_infer(raw_server: ServerProcess) -> None:
    base = raw_server.base
    url = base + "/predictions/raw"
    async with aiohttp.ClientSession() as session:
        status, _, body = await _post(session, url, b"x", {"aserve-timeout-ms": "soon"})
        assert status == 400 and "aserve-timeout-ms" in orjson.loads(body)["error"]
        await wait_for_stats(session, base, "raw", lambda s: s["pending_request_count"] == 0)
        with frozen(raw_server.worker_pid("raw")):
            held = asyncio.create_task(_post(session, url, b"held"))
            await wait_for_stats(session, base, "raw", lambda s: s["running_batch_count"] == 1)
            # Behind a batch that does not end, a short deadline is refused (503, when
            # admission sees it cannot be met) or passes in the queue (504).
            status, _, body = await _post(session, url, b"late", {"aserve-timeout-ms": "200"})
            assert status in (503, 504), body
        assert (await held)[0] == 200


# --- the handlers page's example, as written ------------------------------------------

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "handlers.md"


def _page_digest() -> tuple[str, list[list[str]]]:
    """The handlers page's raw-body handler (its code) and the commands that serve and ask it."""
    text = PAGE.read_text()
    section = text[text.index("### Raw bodies: `/predictions`") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    bash = re.search(r"```python\n.*?```.*?```bash\n(.*?)```", section, re.S)
    assert code and bash, "the handlers page's /predictions example or its commands are gone"
    lines = textwrap.dedent(bash.group(1)).replace("\\\n", " ").splitlines()
    commands = [shlex.split(re.sub(r"\s+#.*$", "", line)) for line in lines if line.strip()]
    return textwrap.dedent(code.group(1)), commands


def _as_curl_sends(words: list[str], port: int, folder: Path) -> tuple[str, Any, dict[str, str]]:
    """The URL, body and headers curl sends for ``words`` (the flags the page uses)."""
    assert words[0] == "curl", words
    url, data, headers = "", None, {}
    args = iter(words[1:])
    for word in args:
        if word == "-s":
            continue
        if word == "-H":  # replaces the default Content-Type of the data flags
            name, _, value = next(args).partition(":")
            headers[name] = value.strip()
        elif word in ("--data-binary", "-d"):
            value = next(args)
            data = (folder / value[1:]).read_bytes() if value.startswith("@") else value.encode()
            headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # curl's
        elif word == "-F":
            name, _, value = next(args).partition("=@")
            data = data or aiohttp.FormData()
            ctype = mimetypes.guess_type(value)[0] or "application/octet-stream"
            data.add_field(name, (folder / value).read_bytes(), filename=value, content_type=ctype)
        else:
            assert word.startswith("localhost:8000/"), f"curl flag {word!r} not handled here"
            url = word.replace("localhost:8000", f"http://127.0.0.1:{port}")
    return url, data, headers


async def test_the_handlers_page_digest_example_works_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler saved as the handlers page says, ``aserve serve`` on it from its folder,
    and the page's curl lines (raw bytes, multipart files, V2 tensors) answered."""
    code, commands = _page_digest()
    serve, *curls = commands
    assert serve[:2] == ["aserve", "serve"], serve
    module = serve[2].partition(":")[0]
    (tmp_path / f"{module}.py").write_text(code)
    images = {name: bytes(range(256)) * (i + 3) for i, name in enumerate(("cat.jpg", "dog.jpg"))}
    for name, data in images.items():
        (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)  # the server imports the handler from the folder it runs in
    srv = start_server(None, argv=[*serve[1:], "--port", "0", "--no-grpc"])
    *asks, (*scrape, bar, grep, pattern) = curls
    assert (bar, grep) == ("|", "grep"), scrape
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for words in asks:
                url, data, headers = _as_curl_sends(words, srv.port, tmp_path)
                status, _, body = await _post(session, url, data, headers)
                assert status == 200, (words, body)
                answers.append(orjson.loads(body))
            url, _, _ = _as_curl_sends(scrape, srv.port, tmp_path)
            async with session.get(url) as r:
                metrics = [
                    line for line in (await r.text()).splitlines() if re.match(pattern, line)
                ]
    finally:
        srv.stop()
    raw, parts, v2 = answers
    cat = images["cat.jpg"]
    assert raw == {"length": len(cat), "sha256": hashlib.sha256(cat).hexdigest()}
    both = b"".join(images.values())
    assert parts == {"length": len(both), "sha256": hashlib.sha256(both).hexdigest()}
    assert v2["outputs"][0]["name"] == "LENGTH" and v2["outputs"][0]["data"] == [5]
    seen = {"raw": len(cat) + len(both), "v2": 5}
    assert sorted(metrics) == sorted(
        f'{pattern[1:]}{{model="digest",route="{route}",version="1"}} {n:.1f}'
        for route, n in seen.items()
    )
