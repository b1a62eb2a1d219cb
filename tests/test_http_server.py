"""Server behaviour over HTTP: batching, deadlines, admission, disconnects, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import gzip

import aiohttp
import numpy as np
import pytest
import torch
from helpers import frozen, stats, v2_body, wait_for_stats, wait_idle


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def _post(session, url, body, **kw):
    async with session.post(url, json=body, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


async def test_concurrent_requests_are_batched_and_answered_per_request(
    server, session, eager_models
):
    base = server.base
    before = await stats(session, base, "affine")
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(64)]
    url = f"{base}/v2/models/affine/infer"
    results = await asyncio.gather(
        *(_post(session, url, v2_body("INPUT0", x.ravel().tolist(), [1, 16])) for x in xs)
    )
    after = await stats(session, base, "affine")
    model = eager_models["affine"]
    for x, (status, body, _) in zip(xs, results, strict=True):
        assert status == 200, body
        want = model(torch.from_numpy(x)).detach().numpy().ravel()
        np.testing.assert_allclose(body["outputs"][0]["data"], want, rtol=1e-5, atol=1e-5)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < inferences, "64 concurrent requests ran one at a time"


async def test_request_batch_dimension_larger_than_one(server, session, eager_models):
    x = np.arange(48, dtype=np.float32).reshape(3, 16) / 10
    status, body, _ = await _post(
        session, f"{server.base}/v2/models/affine/infer", v2_body("INPUT0", x.tolist(), [3, 16])
    )
    assert status == 200
    out = body["outputs"][0]
    assert out["shape"] == [3, 16]
    want = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.array(out["data"]).reshape(3, 16), want, rtol=1e-5, atol=1e-5)


@contextlib.asynccontextmanager
async def _spin_held(server, session):
    """Occupy the spin model's only instance: one request runs on its frozen worker
    until the block ends. Yields that request's task; it answers after the block."""
    base = server.base
    await wait_idle(session, base, "spin")
    with frozen(server.worker_pid("spin")):
        body = v2_body("X", [0.25, 0.25], [1, 2], parameters={"timeout_ms": 60_000})
        task = asyncio.create_task(_post(session, f"{base}/v2/models/spin/infer", body))
        await wait_for_stats(session, base, "spin", lambda s: s["running_batch_count"] == 1)
        yield task


async def _held_answer(task) -> None:
    status, body, _ = await task
    assert status == 200, body
    assert body["outputs"][0]["data"] == [pytest.approx(0.5)]


async def test_timeout_in_queue_answers_504_and_server_keeps_serving(server, session):
    base = server.base
    async with _spin_held(server, session) as held:
        before = await stats(session, base, "spin")
        status, body, _ = await _post(
            session, f"{base}/v2/models/spin/infer",
            v2_body("X", [1.0, 2.0], [1, 2], parameters={"timeout_ms": 100}),
        )  # fmt: skip
        assert status == 504, body
        assert "timed out" in body["error"]
        assert not held.done()
    await _held_answer(held)
    after = await stats(session, base, "spin")
    assert after["timed_out"] == before["timed_out"] + 1
    # The server still serves, the header spelling of the timeout included.
    status, body, _ = await _post(
        session, f"{base}/v2/models/spin/infer", v2_body("X", [1.0, 2.0], [1, 2]),
        headers={"aserve-timeout-ms": "5000"},
    )  # fmt: skip
    assert status == 200 and body["outputs"][0]["data"] == [3.0]


async def test_full_queue_answers_429_at_once(server, session):
    base = server.base
    url = f"{base}/v2/models/spin/infer"
    small = v2_body("X", [1.0], [1, 1])
    async with _spin_held(server, session) as held:
        queued = [asyncio.create_task(_post(session, url, small)) for _ in range(2)]
        await wait_for_stats(session, base, "spin", lambda s: s["pending_request_count"] == 2)
        status, body, headers = await _post(session, url, small)
        assert status == 429
        assert "max_queue_size 2" in body["error"]
        assert headers["Retry-After"] == "1"
        assert not held.done(), "the refusal waited for the running batch"
    await _held_answer(held)
    for status, body, _ in await asyncio.gather(*queued):
        assert status == 200, body


async def test_unmeetable_deadline_answers_503_at_once(server, session):
    # "sleepy" sleeps 1 s per batch, as measured at warm-up (more on a busy machine).
    status, body, _ = await _post(
        session, f"{server.base}/v2/models/sleepy/infer",
        v2_body("X", [1.0, 2.0], [1, 2], parameters={"timeout_ms": 1}),
    )  # fmt: skip
    assert status == 503, body
    assert "cannot meet the request's deadline" in body["error"]
    status, body, _ = await _post(
        session, f"{server.base}/v2/models/sleepy/infer", v2_body("X", [1.0, 2.0], [1, 2])
    )
    assert status == 200 and body["outputs"][0]["data"] == [3.0]


async def test_client_disconnect_removes_the_request_from_the_queue(server, session):
    base = server.base
    url = f"{base}/v2/models/spin/infer"
    async with _spin_held(server, session) as held:
        before = await stats(session, base, "spin")
        # The client gives up once the server has queued its request.
        queued = asyncio.create_task(_post(session, url, v2_body("X", [1.0], [1, 1])))
        await wait_for_stats(session, base, "spin", lambda s: s["pending_request_count"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        # Gone from the queue while the held batch is still running.
        gone = await wait_for_stats(
            session, base, "spin", lambda s: s["pending_request_count"] == 0
        )
        assert gone["cancelled"] == before["cancelled"] + 1
        assert not held.done()
    await _held_answer(held)
    idle = await wait_idle(session, base, "spin")
    assert idle["inference_count"] == before["inference_count"] + 1  # only the held request ran


BAD_INPUTS = [
    # (description, model, body or raw bytes, status, words the message must contain)
    ("not json", "affine", b"{nope", 400, ["not valid JSON"]),
    ("no inputs", "affine", {"inputs": []}, 400, ["inputs"]),
    ("unknown input", "affine", v2_body("WRONG", [0.0] * 16, [1, 16]), 400, ["WRONG", "INPUT0"]),
    ("wrong datatype", "affine", v2_body("INPUT0", [0] * 16, [1, 16], "INT32"), 400,
     ["INPUT0", "INT32", "FP32"]),
    ("wrong shape", "affine", v2_body("INPUT0", [0.0] * 15, [1, 15]), 400, ["INPUT0", "shape"]),
    ("no batch dim", "affine", v2_body("INPUT0", [0.0] * 16, [16]), 400, ["INPUT0", "shape"]),
    ("data count", "affine", v2_body("INPUT0", [0.0] * 10, [1, 16]), 400, ["INPUT0", "10", "16"]),
    ("not numbers", "affine", v2_body("INPUT0", ["a"] * 16, [1, 16]), 400, ["INPUT0", "FP32"]),
    ("no data", "affine", {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32"}]},
     400, ["INPUT0", "no data"]),
    ("batch too big", "affine", v2_body("INPUT0", [0.0] * 16 * 33, [33, 16]), 400,
     ["batch size 33", "max_batch_size 32"]),
    ("missing input", "pair", v2_body("A", [0.0] * 8, [1, 8]), 400, ["missing input", "B"]),
    ("unknown output", "affine", v2_body("INPUT0", [0.0] * 16, [1, 16], outputs=[{"name": "NOPE"}]),
     400, ["NOPE", "OUTPUT0"]),
    ("bad timeout", "affine", v2_body("INPUT0", [0.0] * 16, [1, 16], parameters={"timeout_ms": -5}),
     400, ["timeout_ms"]),
    ("unknown model", "nosuch", v2_body("INPUT0", [0.0] * 16, [1, 16]), 404, ["nosuch"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "model", "body", "status", "words"), BAD_INPUTS,
                         ids=[c[0] for c in BAD_INPUTS])  # fmt: skip
async def test_bad_input_gets_its_status_and_a_message_naming_it(
    server, session, case, model, body, status, words
):
    url = f"{server.base}/v2/models/{model}/infer"
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(url, **kw) as r:
        assert r.status == status
        assert r.content_type == "application/json"
        message = (await r.json())["error"]
    for word in words:
        assert word in message, f"{case}: {word!r} not in {message!r}"


async def test_binary_size_mismatch_names_the_tensor(server, session):
    header = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":60}}]}'
    async with session.post(
        f"{server.base}/v2/models/affine/infer", data=header + bytes(60),
        headers={"Inference-Header-Content-Length": str(len(header))},
    ) as r:  # fmt: skip
        assert r.status == 400
        message = (await r.json())["error"]
    assert "INPUT0" in message and "60" in message and "64" in message


async def test_unknown_version_and_wrong_method_and_path(server, session):
    async with session.get(f"{server.base}/v2/models/affine/versions/9") as r:
        assert r.status == 404
        assert (
            "Request for unknown model: 'affine' version 9 is not found"
            in (await r.json())["error"]
        )
    async with session.post(f"{server.base}/v2/health/live") as r:
        assert r.status == 405
        assert "POST" in (await r.json())["error"]
    async with session.get(f"{server.base}/v2/nothing/here") as r:
        assert r.status == 404
        assert "error" in await r.json()


async def test_body_over_the_limit_answers_413(server, session):
    big = v2_body("INPUT0", [0.0] * (16 * 32), [32, 16])
    big["padding"] = "x" * (3 * 1024 * 1024)
    status, body, _ = await _post(session, f"{server.base}/v2/models/affine/infer", big)
    assert status == 413
    assert "max_request_bytes" in body["error"]

    # A chunked body (no Content-Length) over the limit is refused too.
    async def chunks():
        for _ in range(40):
            yield b" " * 100_000

    async with session.post(f"{server.base}/v2/models/affine/infer", data=chunks()) as r:
        assert r.status == 413
        assert "max_request_bytes" in (await r.json())["error"]


async def test_gzip_request_and_response(server, session, eager_models):
    import gzip
    import json

    x = np.linspace(-1, 1, 16, dtype=np.float32)
    raw = json.dumps(v2_body("INPUT0", x.tolist(), [1, 16])).encode()
    async with session.post(
        f"{server.base}/v2/models/affine/infer", data=gzip.compress(raw),
        headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
    ) as r:  # fmt: skip
        assert r.status == 200
        assert r.headers["Content-Encoding"] == "gzip"
        body = await r.json()
    want = eager_models["affine"](torch.from_numpy(x[None])).detach().numpy().ravel()
    np.testing.assert_allclose(body["outputs"][0]["data"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["/v2/models/affine/infer", "/v2/repository/index"])
@pytest.mark.parametrize(
    ("encoding", "body", "words"),
    [
        ("gzip", b"not compressed at all", ["gzip"]),
        ("deflate", b"1", ["deflate"]),
        ("gzip", gzip.compress(b'{"inputs": []}')[:-12], ["gzip", "ends early"]),
        ("zstd", b"xx", ["'zstd' is not supported"]),
    ],
    ids=["gzip", "deflate", "truncated", "zstd"],
)
async def test_body_that_does_not_decode_as_its_content_encoding_answers_400(
    server, session, path, encoding, body, words
):
    # Once a 500 (aiohttp's read() raised), or aiohttp's text/plain 400 and a
    # closed connection when the body came in the packet of the headers.
    headers = {"Content-Encoding": encoding}
    for _ in range(3):  # the connection is kept: the same session goes on
        async with session.post(server.base + path, data=body, headers=headers) as r:
            assert r.status == 400
            message = (await r.json())["error"]
        assert all(w in message for w in words), message


async def test_a_gzip_bomb_is_refused_with_413(server, session):
    bomb = gzip.compress(b" " * (3 * 1024 * 1024))  # 3 KiB that inflate past 2 MiB
    async with session.post(
        f"{server.base}/v2/models/affine/infer", data=bomb, headers={"Content-Encoding": "gzip"}
    ) as r:
        assert r.status == 413
        assert "inflates to over the limit max_request_bytes" in (await r.json())["error"]
