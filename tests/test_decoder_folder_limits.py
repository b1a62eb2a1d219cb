"""Hostile decoder model folders: what a folder declares is bounded before it is built.

Each case is a real folder (the tiny GPT-2 of ``aserve.engines.decoder.tiny``
with one file changed) that once cost seconds and gigabytes before it was
refused, or was never refused: 30 million layers, a billion-word vocabulary,
a config.json whose weights are not in the files, a 150 MB tokenizer.json
(``tokenizers`` holds the GIL while it builds one, so the event loop stopped
for seconds), an oversized config.json. Each is refused with the field and the
limit named, on every path a folder takes: ``aserve serve DIR
--print-config``, a server's start, and a hot reload beside a model that
keeps serving, with the event loop watched (``stall_watch``).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import ServerProcess, start_server, write_config
from gen_helpers import GENERATION
from reload_helpers import config_status, rewrite_config, wait_attempts
from stall_watch import watch_loop

from aserve.engines.decoder.tiny import END, build_tiny_gpt2

pytestmark = pytest.mark.timeout(120)

LIMITS = "generation.checkpoint_limits"
BIG_TOKENIZER_BYTES = 150 * 2**20
PROMPT = "The quick brown fox jumps over the lazy dog."


def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def big_tokenizer_json(path: Path, target_bytes: int) -> None:
    """Grow ``path``'s tokenizer.json to ``target_bytes`` or more with vocabulary
    entries no merge reaches: still a valid tokenizer, which ``tokenizers``
    takes seconds to build (and encodes as before)."""
    text = path.read_text()
    start = re.search(r'"vocab"\s*:\s*\{', text)
    assert start, "a BPE tokenizer.json has a vocab object"
    pad = "x" * 200
    first = len(json.loads(text)["model"]["vocab"])
    count = target_bytes // (len(pad) + 16) + 1
    with path.open("w") as f:
        f.write(text[: start.end()])
        f.write("".join(f'"{pad}{i}":{i},' for i in range(first, first + count)))
        f.write(text[start.end() :])


def _big_tokenizer(folder: Path) -> None:
    big_tokenizer_json(folder / "tokenizer.json", BIG_TOKENIZER_BYTES)


def _big_config(folder: Path) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(400_000)}  # ~8 MB
    path.write_text(json.dumps(config))


# name -> (what is done to the tiny folder, fragments the refusal must hold)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "layers": (
        _edit_config(n_layer=30_000_000),
        ("'n_layer' is 30000000", f"over the limit {LIMITS}.max_layers (1024)"),
    ),
    "vocab": (
        _edit_config(vocab_size=10**9),
        ("'vocab_size' is 1000000000", f"over the limit {LIMITS}.max_vocab_size (2097152)"),
    ),
    "mismatched-layers": (
        _edit_config(n_layer=1000),
        (
            "weight 'transformer.h.2.ln_1.weight' is missing",
            "config.json (1000 layers,",
            "parameters, the safetensors files hold",
        ),
    ),
    "mismatched-width": (
        _edit_config(n_embd=8192),
        ("weight 'transformer.wte.weight' has shape [400, 128], config.json implies [400, 8192]",),
    ),
    "tokenizer-size": (
        _big_tokenizer,
        ("tokenizer.json", f"over the limit {LIMITS}.max_tokenizer_bytes (16777216 bytes)"),
    ),
    "config-size": (
        _big_config,
        ("config.json", f"over the limit {LIMITS}.max_config_file_bytes (4194304 bytes)"),
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("folder-limits") / "tiny"
    folder.mkdir()
    build_tiny_gpt2(folder)
    return folder


@pytest.fixture(scope="module")
def hostile(tiny: Path) -> Iterator[Callable[[str], Path]]:
    """The folder of a case, built the first time it is asked for."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            folder = shutil.copytree(tiny, tiny.parent / case)
            CASES[case][0](folder)
            built[case] = folder
        return built[case]

    yield get


def _assert_names(text: str, case: str) -> None:
    for fragment in CASES[case][1]:
        assert fragment in text, f"{case}: {fragment!r} not in:\n{text[-2000:]}"
    assert "Traceback" not in text, text[-3000:]


def _aserve(*args: str, timeout_s: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_print_config_refuses_the_folder(case: str, hostile: Callable[[str], Path]) -> None:
    folder = hostile(case)
    done = _aserve("serve", str(folder), "--print-config")
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    assert done.stderr.startswith(f"aserve serve: error: {folder}"), done.stderr[-2000:]
    _assert_names(done.stderr, case)


@pytest.mark.parametrize("case", list(CASES))
def test_server_start_refuses_the_folder(
    case: str, hostile: Callable[[str], Path], tmp_path: Path
) -> None:
    model = {"name": "hostile", "engine": "decoder", "path": str(hostile(case)),
             "generation": GENERATION}  # fmt: skip
    config = write_config(tmp_path, {"models": [model]})
    done = _aserve("--config", str(config), "--port", "0")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "model 'hostile/1' failed to load" in done.stderr, done.stderr[-2000:]
    _assert_names(done.stderr, case)


# --- hot reload beside a model that keeps serving ------------------------------------


@pytest.fixture(scope="module")
def served(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("folder-limits-server")
    good = {"name": "gpt2", "engine": "decoder", "path": str(tiny), "generation": GENERATION}
    config = write_config(folder, {"models": [good]})
    server = start_server(config)
    yield server, config, good
    server.stop()


async def _complete(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    async with session.post(base + "/v1/completions", json=body) as r:
        doc = await r.json()
        assert r.status == 200, doc
        return doc


def _hup_and_wait(server: ServerProcess) -> dict[str, Any]:
    before = config_status(server.base)["reloads"]
    server.proc.send_signal(signal.SIGHUP)
    return wait_attempts(server.base, before)


@pytest.mark.parametrize("case", list(CASES))
async def test_hot_reload_refuses_the_folder_without_stalling(
    case: str, hostile: Callable[[str], Path], served: Any
) -> None:
    server, config, good = served
    bad = {"name": "hostile", "engine": "decoder", "path": str(hostile(case)),
           "generation": GENERATION}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        want = await _complete(session, server.base, "gpt2")
        try:
            async with watch_loop(server.base):
                rewrite_config(config, {"models": [good, bad]})
                status = await asyncio.to_thread(_hup_and_wait, server)
                # The model beside it answers as before, the same text.
                assert (await _complete(session, server.base, "gpt2"))["choices"] == want["choices"]
        finally:
            rewrite_config(config, {"models": [good]})
    assert status["last_reload"]["result"] == "rejected", status
    error = status["last_error"]["error"]
    assert "models[1]: model 'hostile/1' failed to load" in error, error
    _assert_names(error, case)


# --- what a tokenizer.json asks of encoding ----------------------------------------------


def _padded(tiny: Path) -> Path:
    """The tiny tokenizer, saved with padding to 100,000 tokens and truncation to 3."""
    from tokenizers import Tokenizer

    folder = shutil.copytree(tiny, tiny.parent / "padded")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_padding(length=100_000, pad_id=tok.token_to_id(END), pad_token=END)
    tok.enable_truncation(max_length=3)
    tok.save(str(folder / "tokenizer.json"))
    return folder


async def test_a_tokenizers_padding_and_truncation_do_not_reach_prompts(
    tiny: Path, served: Any
) -> None:
    """A prompt is encoded as it is: a file's fixed padding (allocated per
    request) and truncation (a prompt cut silently) are turned off at load."""
    server, config, good = served
    padded = {**good, "name": "padded", "path": str(_padded(tiny))}
    async with aiohttp.ClientSession() as session:
        want = await _complete(session, server.base, "gpt2")
        rewrite_config(config, {"models": [good, padded]})
        try:
            status = await asyncio.to_thread(_hup_and_wait, server)
            assert status["last_reload"]["result"] == "ok", status
            got = await _complete(session, server.base, "padded")
        finally:
            rewrite_config(config, {"models": [good]})
            await asyncio.to_thread(_hup_and_wait, server)
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > 3
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


# --- the engine itself ----------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_refuses_the_folder_on_a_step_thread_too(
    case: str, hostile: Callable[[str], Path]
) -> None:
    """``"step_process": false`` loads everything in the server's process
    (``DecoderEngine.load``); the same checks refuse the folder there."""
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import CheckpointError, DecoderEngine

    engine = DecoderEngine(hostile(case), GenerationConfig(**GENERATION))
    with pytest.raises(CheckpointError) as exc:
        engine.load()
    _assert_names(str(exc.value), case)


def test_a_raised_limit_admits_the_folder(hostile: Callable[[str], Path]) -> None:
    """The limits are the config's: raised, the 8 MB config.json loads."""
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine

    limits = {"max_config_file_bytes": 16 * 2**20}
    engine = DecoderEngine(
        hostile("config-size"), GenerationConfig(**GENERATION, checkpoint_limits=limits)
    )
    engine.load()
    assert engine.spec.num_layers == 2
    assert engine.tokenizer.encode(PROMPT)


def test_rope_tables_follow_the_cache_not_the_declared_context(
    tmp_path: Path,
) -> None:
    """A Llama declaring ten million positions (Llama 4 declares 10,485,760)
    allocates RoPE tables for its cache's length, not for every position."""
    import lm_models

    from aserve.engines.decoder import DecoderModel

    folder = shutil.copytree(lm_models.tiny_model("llama", tmp_path / "lms"), tmp_path / "long")
    _edit_config(max_position_embeddings=10_000_000)(folder)
    model = DecoderModel.load(folder)
    model.new_cache(2, 64)
    assert model._cos is not None and model._cos.shape[0] == 64
