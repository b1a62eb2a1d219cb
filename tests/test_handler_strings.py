"""Strings that cross between a client, a python handler and the server's encoders.

A multipart filename with bytes that are not UTF-8 reaches the handler as
text with U+FFFD in their place (and its bytes as sent, apart); what the
handler then does with it, or with any string of its own (a metric's label
value or help, an answer, a content type, an exception's message), must
never break ``/metrics`` or another request: a value that cannot be encoded
is replaced where it enters the metrics, and an answer that cannot be
encoded is a clear error for its own request. The server is real and so are
its clients; the multipart bodies are written by hand, since a client
library writes only UTF-8 filenames.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import ServerProcess, spec, start_server, write_config
from prometheus_client.parser import text_string_to_metric_families
from reload_helpers import copy_handler

from aserve.obs.handler_metrics import MAX_LABEL_VALUE_CHARS

pytestmark = pytest.mark.timeout(120)

BOUNDARY = b"hostileB0undary"
MULTIPART = "multipart/form-data; boundary=" + BOUNDARY.decode()
FFFD = "\ufffd"


def strings_model(name: str, executor: str) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "hostile_strings:HostileStrings",
        "executor": executor,
        "inputs": [spec("TEXT", "BYTES", [1])], "outputs": [spec("ECHO", "BYTES", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 0},
    }  # fmt: skip


@pytest.fixture(scope="module")
def strings_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder: Path = tmp_path_factory.mktemp("handler-strings")
    copy_handler(folder, "hostile_strings")
    models = [strings_model("strings", "thread"), strings_model("strings_proc", "process")]
    srv = start_server(write_config(folder, {"models": models}))
    yield srv
    srv.stop()
    # Nothing a handler returned broke a log line either (logging prints its own
    # "--- Logging error ---" traceback for text it cannot encode).
    log = srv.log_text()
    assert "Traceback" not in log and "Logging error" not in log, log[-5000:]


def multipart(*parts: tuple[bytes, bytes | None, bytes | None, bytes]) -> bytes:
    """(name, filename, content type, data) parts, header bytes as given."""
    out = b""
    for name, filename, ctype, data in parts:
        out += b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="' + name + b'"'
        if filename is not None:
            out += b'; filename="' + filename + b'"'
        out += b"\r\n"
        if ctype is not None:
            out += b"Content-Type: " + ctype + b"\r\n"
        out += b"\r\n" + data + b"\r\n"
    return out + b"--" + BOUNDARY + b"--\r\n"


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[tuple[str, ...], float]:
    """/metrics must answer 200 with exposition Prometheus' parser reads, in both formats."""
    async with session.get(
        base + "/metrics", headers={"Accept": "application/openmetrics-text"}
    ) as r:
        assert r.status == 200, await r.text()
        assert (await r.read()).decode().endswith("# EOF\n")
    async with session.get(base + "/metrics") as r:
        assert r.status == 200, await r.text()
        text = (await r.read()).decode()
    return {
        (s.name, *sorted(f"{k}={v}" for k, v in s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def still_serves(session: aiohttp.ClientSession, base: str) -> None:
    """The routes a hostile request went through answer others as before."""
    doc = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["ok"]}]}
    for model in ("strings", "strings_proc"):
        async with session.post(f"{base}/v2/models/{model}/infer", json=doc) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["outputs"][0]["data"] == ["ok"]
    body = multipart((b"f", b"plain.txt", b"text/plain", b"x"))
    async with session.post(
        base + "/predictions/strings", data=body, headers={"Content-Type": MULTIPART}
    ) as r:
        assert r.status == 200, await r.text()
    async with session.get(base + "/v2/dashboard/stats") as r:
        assert r.status == 200, await r.text()


async def test_a_non_utf8_filename_reaches_the_handler_as_text_and_bytes(
    strings_server: ServerProcess,
) -> None:
    base = strings_server.base
    raw_name = b"caf\xe9 \xff\xfe.jpg"  # Latin-1 and stray bytes: not UTF-8
    body = multipart(
        (b"fi\xe9ld", raw_name, b"image/\xff", b"DATA"),
        (b"ok", "über.txt".encode(), b"text/plain", b"x"),
    )
    async with aiohttp.ClientSession() as session:
        url = base + "/predictions/strings"
        headers = {"Content-Type": MULTIPART}
        async with session.post(url, data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            doc = await r.json()
        assert doc["parts"] == [
            {
                "name": f"fi{FFFD}ld",
                "filename": f"caf{FFFD} {FFFD}{FFFD}.jpg",
                "filename_bytes": raw_name.hex(),
                "content_type": f"image/{FFFD}",
            },
            {
                "name": "ok",
                "filename": "über.txt",
                "filename_bytes": "über.txt".encode().hex(),
                "content_type": "text/plain",
            },
        ]
        # Echoed as the answer's text: UTF-8 with the replacement characters.
        async with session.post(url + "?answer=text", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert await r.read() == f"caf{FFFD} {FFFD}{FFFD}.jpg".encode()
        # The request's own Content-Type, with a byte that is not UTF-8 in it.
        reader, writer = await asyncio.open_connection("127.0.0.1", strings_server.port)
        writer.write(
            b"POST /predictions/strings HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: %s; note=\xff\r\nContent-Length: %d\r\n\r\n%s"
            % (MULTIPART.encode(), len(body), body)
        )
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        doc = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert doc["content_type"] == f"{MULTIPART}; note={FFFD}"
        # The labels the handler set from it: /metrics answers, now and on every scrape.
        for _ in range(2):
            got = await scrape(session, base)
            key = (
                "aserve_handler_uploads_total",
                f"field=fi{FFFD}ld",
                f"filename=caf{FFFD} {FFFD}{FFFD}.jpg",
                "model=strings",
                f"type=image/{FFFD}",
                "version=1",
            )
            assert got[key] == 3.0
        await still_serves(session, base)


LONE = "\udcff"  # what an undecodable byte becomes under surrogateescape
HOSTILE_LABELS = [LONE, "\ud800", 'a\nb"c\\d', "\x00nul", "x" * 10_000, "é" * 4]


@pytest.mark.parametrize("value", HOSTILE_LABELS, ids=lambda v: repr(v)[:16])
async def test_label_values_a_handler_sets_cannot_break_metrics(
    strings_server: ServerProcess, value: str
) -> None:
    base = strings_server.base
    async with aiohttp.ClientSession() as session:
        # The stdlib's JSON writer escapes lone surrogates, and its reader makes them
        # lone surrogates again in the handler.
        async with session.post(
            base + "/predictions/strings",
            data=json.dumps({"label": value}),
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 200, await r.text()
        got = await scrape(session, base)
        shown = {
            k[2].removeprefix("value=")
            for k in got
            if k[0] == "aserve_handler_echo_total" and k[1] == "model=strings"
        }
        assert _replaced(value) in shown, shown
        await still_serves(session, base)


def _replaced(value: str) -> str:
    """What a label value becomes in /metrics: each lone surrogate as U+FFFD, and
    a value over the length limit folded into "other"."""
    if len(value) > MAX_LABEL_VALUE_CHARS:
        return "other"
    return "".join(FFFD if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)


async def test_a_v2_text_that_is_not_utf8_labels_metrics_in_the_server_and_the_worker(
    strings_server: ServerProcess,
) -> None:
    """V2 BYTES decoded with surrogateescape by the handler: its labels are replaced in
    the front's set and in the worker process's (whose updates cross as msgpack)."""
    base = strings_server.base
    raw = b"\xff\xfe-v2"
    async with aiohttp.ClientSession() as session:
        for model in ("strings", "strings_proc"):
            # The binary tensor extension carries the bytes as they are.
            header = orjson.dumps(
                {
                    "inputs": [
                        {
                            "name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                            "parameters": {"binary_data_size": 4 + len(raw)},
                        }
                    ],
                    "outputs": [{"name": "ECHO", "parameters": {"binary_data": True}}],
                    "parameters": {"answer": "bytes"},
                }
            )  # fmt: skip
            body = header + len(raw).to_bytes(4, "little") + raw
            async with session.post(
                f"{base}/v2/models/{model}/infer",
                data=body,
                headers={"Inference-Header-Content-Length": str(len(header))},
            ) as r:
                assert r.status == 200, await r.text()
                answer = await r.read()
                assert answer.endswith(raw)  # the handler gave the bytes back as sent
        label = f"value={FFFD}{FFFD}-v2"
        # The worker's updates come with its batch's answer: there by now.
        got = await scrape(session, base)
        for model in ("strings", "strings_proc"):
            for name in ("aserve_handler_echo_total", "aserve_handler_inferred_total"):
                assert got[(name, f"model={model}", label, "version=1")] == 1.0, (model, name)
        await still_serves(session, base)


# What a handler returns or raises: (the request's JSON, the status, what the answer says).
ANSWERS = [
    ({"answer": "str", "text": f"a{LONE}b"}, 500, "is not valid UTF-8"),
    ({"answer": "json", "text": f"a{LONE}b"}, 500, "is not valid UTF-8"),
    ({"answer": "typed", "text": "text/plain\r\nX-Injected: 1"}, 500, "not printable ASCII"),
    ({"answer": "typed", "text": f"text/{LONE}"}, 500, "not printable ASCII"),
    ({"answer": "raise", "text": f"boom {LONE}\r\nX-Injected: 1"}, 500, "ValueError: boom"),
    ({"metric": f"bad{LONE}"}, 500, "is not valid"),
    ({"label_name": f"l{LONE}"}, 500, "label name"),
    ({"metric": "late_help", "help": f"help {LONE}\\ with\nlines"}, 200, '"ok"'),
    ({"metric": "late_huge_help", "help": "h" * 100_000}, 500, "help must be text"),
]


@pytest.mark.parametrize(("doc", "status", "says"), ANSWERS, ids=lambda x: repr(x)[:40])
async def test_what_a_handler_answers_fails_alone_or_is_made_safe(
    strings_server: ServerProcess, doc: dict[str, Any], status: int, says: str
) -> None:
    base = strings_server.base
    async with aiohttp.ClientSession() as session:
        async with session.post(
            base + "/predictions/strings",
            data=json.dumps(doc),
            headers={"Content-Type": "application/json"},
        ) as r:
            text = await r.text()
            assert r.status == status, text
            assert "X-Injected" not in r.headers
            assert r.content_type == "application/json", text
            assert says in text, text
            if status != 200:
                assert "model 'strings/1'" in (await r.json())["error"]
        got = await scrape(session, base)
        if "help" in doc and status == 200:
            assert ("aserve_handler_late_help_total", "model=strings", "version=1") in got
        await still_serves(session, base)


async def test_a_v2_str_output_that_is_not_utf8_is_a_clear_error(
    strings_server: ServerProcess,
) -> None:
    """The handler returns the text it decoded with surrogateescape as a str: BYTES
    outputs take str as UTF-8, which it is not."""
    base = strings_server.base
    raw = b"\xff"
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
                 "parameters": {"binary_data_size": 4 + len(raw)}}
            ]
        }
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        async with session.post(
            base + "/v2/models/strings/infer",
            data=header + len(raw).to_bytes(4, "little") + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
        ) as r:
            assert r.status == 500, await r.text()
            error = (await r.json())["error"]
        assert "output 'ECHO'" in error and "not valid UTF-8" in error, error
        await scrape(session, base)
        await still_serves(session, base)
