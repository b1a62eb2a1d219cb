"""``builtin:tiny-gpt2``: a decoder model built offline on first use, served end to end.

Servers start on an empty ``ASERVE_CACHE_DIR`` and are driven with the
openai SDK, Triton's generate route and gRPC ``Generate``. Concurrent builds
are forced to interleave as in tests/test_builtin_models.py: every builder
that gets as far as having written its folder waits there for the others,
so that (without the lock) all writes land before any rename.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from conftest import start_server, write_config
from helpers import resolve_in_threads

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve.config import ConfigError, GenerationConfig, parse_config
from aserve.engines import builtin as builtin_models
from aserve.engines.checks import check_model_files

ROOT = Path(__file__).resolve().parent.parent
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
PROMPT = "The quick brown fox"
BUILDERS = 4
WRITE_GATE_S = 3.0  # how long a writer waits for the others before it renames anyway
GENERATION = {"max_num_seqs": 4, "max_model_len": 256, "max_tokens_default": 16}


def greedy_text(folder: Path, prompt: str = PROMPT, max_tokens: int = 24) -> str:
    """What the decoder engine generates greedily from ``folder``, in this process."""
    from aserve.engines.decoder import DecoderEngine
    from aserve.types.generation import SamplingParams

    engine = DecoderEngine(folder, GenerationConfig(max_num_seqs=1, max_model_len=128))
    engine.load()
    seq = engine.new_sequence("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while not seq.finished:
        engine.step([seq] if not seq.output_ids else [], [seq] if seq.output_ids else [])
    return engine.tokenizer.decode(seq.output_ids)


def _post(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(base + route, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _built(cache: Path) -> list[Path]:
    return [p for p in (cache / "builtin").iterdir() if p.name.startswith("tiny-gpt2-")]


async def test_a_server_on_an_empty_cache_serves_chat_generate_and_grpc(tmp_path: Path) -> None:
    """Two models on the builtin (one stepping in a child process, one on a thread)
    load at once, each wanting the same folder built."""
    cache = tmp_path / "cache"
    models = [
        {"name": "tiny-gpt2", "engine": "decoder", "path": "builtin:tiny-gpt2",
         "generation": GENERATION},
        {"name": "tiny-gpt2-thread", "engine": "decoder", "path": "builtin:tiny-gpt2",
         "generation": {**GENERATION, "step_process": False}},
    ]  # fmt: skip
    config = write_config(tmp_path, {"grpc": {"port": 0}, "models": models})
    srv = start_server(config, extra_env={"ASERVE_CACHE_DIR": str(cache)})
    try:
        client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="tiny-gpt2",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await client.close()
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert len([p for p in pieces if p]) > 1  # streamed piece by piece
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens <= 12
        assert finish == ("length" if usage.completion_tokens == 12 else "stop")
        # The chat template ran: the prompt is more than the user's two tokens.
        assert usage.prompt_tokens > 5

        body = {"text_input": PROMPT, "parameters": {"max_tokens": 24, "temperature": 0}}
        texts = {
            _post(srv.base, f"/v2/models/{m}/generate", body)["text_output"]
            for m in ("tiny-gpt2", "tiny-gpt2-thread")
        }
        assert len(texts) == 1  # one folder, the same weights for both
        (text,) = texts
        assert text.strip()

        async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
            request = apb.GenerateRequest(
                model_name="tiny-gpt2", prompt=PROMPT,
                sampling=apb.SamplingParameters(max_tokens=24, temperature=0),
            )  # fmt: skip
            messages = [m async for m in apb_grpc.GenerationStub(channel).Generate(request)]
        assert len(messages) > 1
        assert "".join(m.text for m in messages) == text
    finally:
        srv.stop()

    (folder,) = [p for p in _built(cache) if p.is_dir()]
    assert {p.name for p in folder.iterdir()} == FILES
    assert not list(folder.parent.glob("*.tmp")), "a builder left its folder behind"
    assert greedy_text(folder) == text  # the server generated from the cached folder


def test_threads_building_it_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    written = threading.Barrier(BUILDERS, timeout=WRITE_GATE_S)
    builtin = builtin_models.BUILDERS["tiny-gpt2"]

    def write_then_wait(folder: Path) -> None:
        builtin.write(folder)
        try:
            written.wait()
        except threading.BrokenBarrierError:
            pass  # the others wait for the lock, not here: go on

    patched = dataclasses.replace(builtin, write=write_then_wait)
    monkeypatch.setitem(builtin_models.BUILDERS, "tiny-gpt2", patched)
    results = resolve_in_threads("tiny-gpt2", BUILDERS)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {BUILDERS} builders failed: {errors!r}"
    assert len(set(results)) == 1
    folder = results[0]
    assert {p.name for p in folder.iterdir()} == FILES
    assert not list(folder.parent.glob("*.tmp")), "a builder left its folder behind"
    assert greedy_text(folder)


def _build_in_process(barrier: Any, cache: str, out: Any) -> None:
    os.environ["ASERVE_CACHE_DIR"] = cache
    barrier.wait()
    try:
        folder = builtin_models.resolve("tiny-gpt2")
        out.put((str(folder), greedy_text(folder)))
    except Exception as exc:
        out.put((f"error: {exc!r}", ""))


def _in_processes(caches: list[Path]) -> list[tuple[str, str]]:
    """Build in one process per entry of ``caches``, released together."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: its own hash seeds
    barrier = ctx.Barrier(len(caches), timeout=60)
    out = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(barrier, str(c), out)) for c in caches]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(not path.startswith("error") for path, _ in results), results
    return results


def test_processes_sharing_a_cache_build_it_at_once(tmp_path: Path) -> None:
    results = _in_processes([tmp_path] * 3)
    assert len({path for path, _ in results}) == 1
    assert len({text for _, text in results}) == 1
    assert not list((tmp_path / "builtin").glob("*.tmp")), "a builder left its folder behind"


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    """Separate caches, separate interpreters: the same bytes, the same greedy text."""
    (a, text_a), (b, text_b) = _in_processes([tmp_path / "a", tmp_path / "b"])
    assert a != b
    for name in FILES:
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
    assert text_a == text_b
    # The cache key names the libraries whose versions the bytes depend on.
    import tokenizers
    import torch

    assert torch.__version__.split("+")[0] in Path(a).name
    assert tokenizers.__version__ in Path(a).name


def test_transformers_reads_it_as_gpt2_and_generates_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder is a genuine Hugging Face GPT-2 checkpoint: transformers'
    greedy tokens are the engine's."""
    import lm_models
    from tokenizers import Tokenizer

    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    folder = builtin_models.resolve("tiny-gpt2")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    want = lm_models.greedy_reference(lm_models.load_reference(folder), prompt, 24)
    assert tok.decode(want) == greedy_text(folder)
    # Printable ASCII only, so streamed pieces join into valid text.
    assert all(c.isprintable() or c == "\n" for c in tok.decode(want))


def test_a_builtin_served_by_the_wrong_engine_is_refused(tmp_path: Path) -> None:
    config = parse_config(
        {"models": [{"name": "m", "engine": "torch", "path": "builtin:tiny-gpt2",
                     "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
                     "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}]}]}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"models\[0\].engine: 'builtin:tiny-gpt2' is served "
                       r"by the decoder engine \(got 'torch'\)"):  # fmt: skip
        check_model_files(config, tmp_path)


def _quick_start_chat_curl() -> tuple[str, str, bytes]:
    """The quick start's serve command, curl URL and body, as its page (and the README,
    tests/test_quickstart.py checks) writes them."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    m = re.search(r"(scripts/serve --config \S+)\ncurl -N (\S+) -d \\\n\s*'([^']+)'", page)
    assert m, "the quick start's streaming chat step is gone"
    return m.group(1), m.group(2), m.group(3).encode()


def _generation_ndjson_curl() -> tuple[str, bytes]:
    """The generation guide's NDJSON example: its URL and body, as the page writes them."""
    page = (ROOT / "docs" / "guide" / "generation.md").read_text()
    m = re.search(r"curl -N -H 'Accept: application/x-ndjson' (\S+) \\\n\s*-d '([^']+)'", page)
    assert m, "the generation guide's NDJSON generate_stream example is gone"
    return m.group(1), m.group(2).encode()


def _openai_example() -> str:
    """The OpenAI-compatible API page's Python example, as it writes it."""
    page = (ROOT / "docs" / "reference" / "openai.md").read_text()
    m = re.search(r"```python\n(.*?)```", page, re.S)
    assert m and 'base_url="http://localhost:8000/v1"' in m.group(1), "the example is gone"
    return m.group(1)


def test_the_quick_start_chat_step_works_as_written(tmp_path: Path) -> None:
    """The quick start's chat step, the generation guide's NDJSON example and the
    OpenAI page's openai example, on the server the quick start started (a fresh
    machine has no other decoder model)."""
    serve, url, body = _quick_start_chat_curl()
    ndjson_url, ndjson_body = _generation_ndjson_curl()
    openai_code = _openai_example()
    config_path = ROOT / serve.split("--config ")[1]
    config = json.loads(config_path.read_text())
    assert config["models"][0]["path"] == "builtin:tiny-gpt2"
    assert config["http"]["port"] == 8000 and url.startswith("localhost:8000/")
    assert "grpc" in config
    config["grpc"]["port"] = 0  # the test's server runs beside others: its own ports
    srv = start_server(
        write_config(tmp_path, config), extra_env={"ASERVE_CACHE_DIR": str(tmp_path / "cache")}
    )
    try:
        # What curl -d sends: a form content type, which the route does not insist on.
        req = urllib.request.Request(
            srv.base + url.removeprefix("localhost:8000"),
            data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [
                line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")
            ]
        req = urllib.request.Request(
            srv.base + ndjson_url.removeprefix("localhost:8000"),
            data=ndjson_body,
            headers={"Accept": "application/x-ndjson",
                     "Content-Type": "application/x-www-form-urlencoded"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.headers["Content-Type"] == "application/x-ndjson"
                lines = [json.loads(line) for line in r.read().splitlines()]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{ndjson_url}: {exc.code} {exc.read()!r}") from None
        code = openai_code.replace("http://localhost:8000", srv.base)
        sdk = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert sdk.returncode == 0, sdk.stderr
    finally:
        srv.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["model"] == "tiny-gpt2" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(line["model_name"] == "tiny-gpt2" for line in lines)
    assert lines[-1]["finish_reason"] in ("stop", "length")
    assert lines[-1]["usage"]["completion_tokens"] <= json.loads(ndjson_body)["max_tokens"]
    printed = sdk.stdout.splitlines()
    assert all(line.startswith("ChatCompletionChunk(") for line in printed), printed[:3]
    assert "usage=CompletionUsage(" in printed[-1]  # stream_options.include_usage
