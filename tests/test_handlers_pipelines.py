"""Python handlers, pipelines, versions side by side and the model repository API,
through tritonclient.http against a real server."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from helpers import sync_stats
from models import Affine, _script_save
from reload_helpers import HANDLERS, config_status, copy_handler, get_json
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(120)

sys.path.insert(0, str(HANDLERS))
from text_tokenizer import tokenize  # noqa: E402

TEXTS = [b"hello", b"a text longer than sixteen bytes", "h\u00e9llo w\u00f6rld".encode()]


def _tokenizer_entry() -> dict[str, Any]:
    return {
        "name": "tokenizer",
        "engine": "python",
        "handler": "text_tokenizer:ByteTokenizer",
        "parameters": {"scale": 1.0, "delay_s": 0.02},
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [
            spec("IDS", "FP32", [16]),
            spec("LENGTH", "INT64", [1]),
            spec("UPPER", "BYTES", [1]),
            spec("BATCH", "INT64", [1]),
        ],
        "batching": {"max_batch_size": 16, "max_delay_ms": 5},
    }


def _pipeline_entry() -> dict[str, Any]:
    return {
        "name": "text_affine",
        "engine": "pipeline",
        "inputs": [spec("TEXT", "BYTES", [1])],
        "outputs": [spec("OUTPUT0", "FP32", [16]), spec("LENGTH", "INT64", [1])],
        "steps": [
            {"model": "tokenizer", "outputs": {"IDS": "INPUT0", "LENGTH": "LENGTH"}},
            {"model": "affine", "version": "1"},
        ],
    }


def _affine(version: str, file: Path) -> dict[str, Any]:
    return model_entry(
        "affine", str(file), [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
        version=version,
    )  # fmt: skip


@pytest.fixture(scope="module")
def affine_v2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second affine model (other weights) for version 2, and its eager module."""
    folder = tmp_path_factory.mktemp("v2")
    module = Affine(seed=3).eval()
    _script_save(module, folder / "affine_v2.pt")
    return folder / "affine_v2.pt", module


@pytest.fixture(scope="module")
def srv(
    model_dir: Path, affine_v2: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("handlers")
    copy_handler(folder)
    config = {
        "grpc": {"port": 0},
        "models": [
            _tokenizer_entry(), _pipeline_entry(),
            _affine("1", model_dir / "affine.pt"), _affine("2", affine_v2[0]),
        ]
    }  # fmt: skip
    server = start_server(write_config(folder, config), extra_args=("--watch-interval", "0"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(srv.url)
    yield c
    c.close()


def _text_input(texts: list[bytes], binary: bool = True) -> httpclient.InferInput:
    inp = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t] for t in texts], dtype=object), binary_data=binary)
    return inp


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_handler_decodes_bytes_input(client, binary):
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=binary)
        for n in ("IDS", "LENGTH", "UPPER", "BATCH")
    ]
    result = client.infer("tokenizer", [_text_input(TEXTS, binary)], outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("IDS"), np.stack([tokenize(t) for t in TEXTS]))
    np.testing.assert_array_equal(result.as_numpy("LENGTH"), [[len(t)] for t in TEXTS])
    upper = [u[0] if isinstance(u[0], bytes) else u[0].encode() for u in result.as_numpy("UPPER")]
    assert upper == [t.upper() for t in TEXTS]  # JSON data comes back as str
    assert result.as_numpy("BATCH").shape == (3, 1)


def test_handler_requests_are_batched_between_pre_and_postprocessing(srv):
    async def many() -> list[dict[str, Any]]:
        url = f"{srv.base}/v2/models/tokenizer/infer"
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> dict[str, Any]:
                body = {
                    "inputs": [
                        {
                            "name": "TEXT",
                            "datatype": "BYTES",
                            "shape": [1, 1],
                            "data": [f"text {i}"],
                        }
                    ]
                }
                async with s.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            return await asyncio.gather(*(one(i) for i in range(24)))

    answers = asyncio.run(many())
    for i, doc in enumerate(answers):
        out = {o["name"]: o["data"] for o in doc["outputs"]}
        assert out["IDS"] == tokenize(f"text {i}".encode()).tolist()
        assert out["UPPER"] == [f"TEXT {i}"]
    # infer sleeps 20 ms per batch: requests that arrive meanwhile share the next one.
    assert max(o["data"][0] for doc in answers for o in doc["outputs"] if o["name"] == "BATCH") > 1


def test_a_slow_postprocess_does_not_make_the_handler_refuse_every_short_deadline(
    tmp_path: Path,
) -> None:
    """Postprocessing that once ran long (a busy machine) must not leave the handler
    reserving more than a request's whole budget for it: that answered every request
    whose deadline was shorter 504 "deadline already passed on arrival", so none ever
    reached postprocessing to correct the estimate."""
    copy_handler(tmp_path)
    config = {"models": [_tokenizer_entry()]}
    server = start_server(write_config(tmp_path, config))
    url = f"{server.base}/v2/models/tokenizer/infer"

    def body(text: str) -> dict[str, Any]:
        return {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1],
                            "data": [text]}]}  # fmt: skip

    async def run() -> tuple[int, str]:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):  # postprocess takes 0.5 s: the tail estimate learns it
                async with s.post(url, json=body("!slow one")) as r:
                    assert r.status == 200, await r.text()
            headers = {"aserve-timeout-ms": "300"}
            async with s.post(url, json=body("quick"), headers=headers) as r:
                return r.status, await r.text()

    try:
        status, text = asyncio.run(asyncio.wait_for(run(), 60))
        assert status == 200, text
    finally:
        server.stop()


def test_user_code_errors_fail_only_the_requests_they_touched(srv, client):
    async def mixed() -> list[tuple[int, dict[str, Any]]]:
        url = f"{srv.base}/v2/models/tokenizer/infer"
        async with aiohttp.ClientSession() as s:

            async def one(text: str) -> tuple[int, dict[str, Any]]:
                body = {
                    "inputs": [
                        {"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}
                    ]
                }
                async with s.post(url, json=body) as r:
                    return r.status, await r.json()

            texts = ["good 1", "!pre broken", "good 2", "!post broken", "good 3"]
            return await asyncio.gather(*(one(t) for t in texts))

    (s1, _), (s2, pre), (s3, _), (s4, post), (s5, _) = asyncio.run(mixed())
    assert (s1, s3, s5) == (200, 200, 200)
    assert s2 == 500 and pre["error"] == (
        "model 'tokenizer/1' preprocess failed: ValueError: cannot tokenize '!pre broken'"
    )
    assert s4 == 500 and "postprocess failed: KeyError" in post["error"]
    # infer fails the batch it ran; the next request is served as usual.
    with pytest.raises(InferenceServerException, match="infer refuses a batch holding"):
        client.infer("tokenizer", [_text_input([b"####"])])
    result = client.infer("tokenizer", [_text_input([b"fine"])])
    assert result.as_numpy("LENGTH").tolist() == [[4]]


def test_pipeline_runs_handler_then_torch_model(client, srv, eager_models):
    texts = [b"pipe", b"lines in memory"]
    result = client.infer(
        "text_affine", [_text_input(texts)],
        outputs=[httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("LENGTH")],
    )  # fmt: skip
    # The same steps done directly: tokenize, then the affine model (version 1).
    ids = torch.from_numpy(np.stack([tokenize(t) for t in texts]))
    want = eager_models["affine"](ids).detach().numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("LENGTH"), [[4], [15]])
    # Served and reported like any model.
    assert client.is_model_ready("text_affine")
    meta = client.get_model_metadata("text_affine")
    assert meta["platform"] == "ensemble" and [i["name"] for i in meta["inputs"]] == ["TEXT"]
    stats = sync_stats(srv.base, "text_affine")
    assert stats["inference_count"] >= 2 and stats["inference_stats"]["success"]["count"] >= 1
    # And over gRPC: its config, with the steps among the parameters.
    import tritonclient.grpc as grpcclient

    gclient = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        cfg = gclient.get_model_config("text_affine").config
        assert (
            cfg.platform == "ensemble"
            and '"model":"tokenizer"' in cfg.parameters["steps"].string_value
        )
        assert gclient.get_model_config("tokenizer").config.backend == "python"
    finally:
        gclient.close()
    # A step's error reaches the pipeline's caller with its message.
    with pytest.raises(InferenceServerException, match="preprocess failed: ValueError"):
        client.infer("text_affine", [_text_input([b"!pre no"])])


def test_versions_side_by_side_default_is_the_highest(client, eager_models, affine_v2):
    x = np.linspace(0, 1, 16, dtype=np.float32)[None]
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    v1 = eager_models["affine"](torch.from_numpy(x)).detach().numpy()
    v2 = affine_v2[1](torch.from_numpy(x)).detach().numpy()
    assert not np.allclose(v1, v2)
    for version, want in (("1", v1), ("2", v2), ("", v2)):
        result = client.infer("affine", [inp], model_version=version)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), want, rtol=1e-5, atol=1e-5)
        assert result.get_response()["model_version"] == (version or "2")
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'affine' version 3 is not found"
    ):
        client.infer("affine", [inp], model_version="3")
    assert client.is_model_ready("affine", "1") and client.is_model_ready("affine", "2")


def test_repository_index_load_and_unload(client, srv):
    def states() -> dict[tuple[str, str], tuple[str, str]]:
        return {
            (m["name"], m["version"]): (m["state"], m.get("reason", ""))
            for m in client.get_model_repository_index()
        }

    everything = {
        ("affine", "1"), ("affine", "2"), ("text_affine", "1"), ("tokenizer", "1"),
    }  # fmt: skip
    assert states() == {key: ("READY", "") for key in everything}

    client.unload_model("tokenizer", unload_dependents=True)
    now = states()
    assert now[("tokenizer", "1")] == ("UNAVAILABLE", "unloaded")
    assert now[("text_affine", "1")] == ("UNAVAILABLE", "unloaded")
    assert now[("affine", "2")] == ("READY", "")
    assert not client.is_model_ready("tokenizer")
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'tokenizer' is not found"
    ):
        client.infer("tokenizer", [_text_input([b"x"])])
    status = config_status(srv.base)
    assert status["last_reload"]["trigger"] == "repository unload 'tokenizer'"
    assert sorted(status["last_reload"]["changes"]["removed"]) == ["text_affine/1", "tokenizer/1"]
    ready_only = get_json_post(srv.base + "/v2/repository/index", b'{"ready": true}')
    assert {(m["name"], m["version"]) for m in ready_only} == {("affine", "1"), ("affine", "2")}

    client.load_model("tokenizer")
    assert client.is_model_ready("tokenizer")
    assert states()[("text_affine", "1")] == ("UNAVAILABLE", "unloaded")  # not loaded with it
    client.load_model("text_affine")
    result = client.infer("text_affine", [_text_input([b"back"])])
    assert result.as_numpy("LENGTH").tolist() == [[4]]
    # Loading a loaded model loads it again, beside the old one.
    client.load_model("affine")
    status = config_status(srv.base)
    assert sorted(status["last_reload"]["changes"]["replaced"]) == ["affine/1", "affine/2"]
    assert states() == {key: ("READY", "") for key in everything}

    with pytest.raises(InferenceServerException, match="model 'nope' is not in"):
        client.load_model("nope")
    # A model folder sent with the load is refused (a config override is taken:
    # tests/test_load_override.py).
    with pytest.raises(InferenceServerException, match=r"file:1/model\.pt are not supported"):
        client.load_model("affine", config="{}", files={"file:1/model.pt": b"x"})


def test_a_pipeline_follows_its_steps_readiness(client, srv):
    """A step unloaded on its own: the pipeline is routed still, but not ready."""
    import tritonclient.grpc as grpcclient

    def index() -> dict[str, tuple[str, str]]:
        models = client.get_model_repository_index()
        return {m["name"]: (m["state"], m.get("reason", "")) for m in models}

    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert client.is_model_ready("text_affine") and grpc.is_model_ready("text_affine")
        client.unload_model("tokenizer")
        why = "pipeline 'text_affine/1' is not ready: step 0 (tokenizer) is not loaded"
        assert not client.is_model_ready("text_affine")
        assert not grpc.is_model_ready("text_affine")
        assert index()["text_affine"] == ("UNAVAILABLE", why)
        assert "text_affine" not in {
            m["name"] for m in get_json_post(srv.base + "/v2/repository/index", b'{"ready": true}')
        }
        status, doc = get_json(srv.base + "/v2/models/text_affine/ready")
        assert (status, doc) == (503, {"error": why})
        with pytest.raises(InferenceServerException, match=r"step 0 \(tokenizer\) is not loaded"):
            client.infer("text_affine", [_text_input([b"x"])])
        # The server is ready only when every model is (see the probes in docs/deployment.md).
        assert not client.is_server_ready() and not grpc.is_server_ready()

        client.load_model("tokenizer")
        assert client.is_model_ready("text_affine") and grpc.is_model_ready("text_affine")
        assert index()["text_affine"] == ("READY", "")
        assert client.is_server_ready()
        result = client.infer("text_affine", [_text_input([b"back"])])
        assert result.as_numpy("LENGTH").tolist() == [[4]]
    finally:
        grpc.close()


def get_json_post(url: str, body: bytes) -> Any:
    import urllib.request

    import orjson

    req = urllib.request.Request(url, data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return orjson.loads(r.read())


def test_a_handler_that_cannot_be_used_exits_2_naming_the_key(tmp_path):
    copy_handler(tmp_path)
    entry = {**_tokenizer_entry(), "handler": "text_tokenizer:NotAHandler"}
    path = write_config(tmp_path, {"models": [entry]})
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "models[0].handler: class 'text_tokenizer:NotAHandler' lacks method(s)" in result.stderr
    assert "Traceback" not in result.stderr


def test_example_configs_serve(tmp_path):
    """configs/pipeline.json (and the handler it shares with configs/handler.json) work as documented."""
    configs = Path(__file__).resolve().parent.parent / "configs"
    server = start_server(configs / "pipeline.json", extra_env={"ASERVE_CACHE_DIR": str(tmp_path)})
    try:
        spec_ = importlib.util.spec_from_file_location("example_text", configs / "text_features.py")
        assert spec_ is not None and spec_.loader is not None
        example = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(example)
        texts = [b"the cat sat on the mat", b"hello"]
        client = httpclient.InferenceServerClient(server.url)
        try:
            result = client.infer("text_scores", [_text_input(texts)])
            direct = client.infer("text_features", [_text_input(texts)])
        finally:
            client.close()
        from aserve.engines.builtin import affine

        features = np.stack([example.features(t) for t in texts])
        np.testing.assert_allclose(direct.as_numpy("FEATURES"), features, rtol=1e-6)
        want = affine()(torch.from_numpy(features)).detach().numpy()
        np.testing.assert_allclose(result.as_numpy("SCORES"), want, rtol=1e-5, atol=1e-5)
        assert [w[0] for w in result.as_numpy("TOP_WORD")] == [b"the", b"hello"]
    finally:
        assert server.stop() == 0
