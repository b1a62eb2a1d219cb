"""How many of aserve's files one request passes through.

A profile hook (``sys.setprofile`` on the loop, ``threading.setprofile`` on
the executor threads the server starts) records every aserve source file
with a frame on the path of one warm request in an in-process server. The
bounds are the layout's promise (ARCHITECTURE.md, "Two walks"): a request
that starts touching more modules than that has grown a layer.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest
from conftest import model_entry, spec
from inprocess import in_process

import aserve

PACKAGE = str(Path(aserve.__file__).parent) + "/"

# What the walks measure today (ARCHITECTURE.md, "Two walks", lists them): a
# change that adds a module to a request's path fails here and has to say why.
MAX_UNARY_INFER_FILES = 14
# 17, and three modules of issue 26: the table of OpenAI fields, the chat
# template's bounded sandbox (a model's template is code to keep in bounds)
# and the pure measures of what its operations would make.
MAX_STREAMED_CHAT_FILES = 20

# The server's own timers, which may fire while the request runs: not its path,
# and neither is what they call (the config watcher parses the config file).
BACKGROUND = {
    "loop/loop_lag.py",
    "obs/registration.py",
    "loop/reload.py",
    "frontends/http/dashboard_history.py",
}
_BACKGROUND_FILES = {PACKAGE + name for name in BACKGROUND}


def _in_background(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it is one of the BACKGROUND timers' code."""
    while frame is not None:
        if frame.f_code.co_filename in _BACKGROUND_FILES:
            return True
        frame = frame.f_back
    return False


TINY_GPT2 = {
    "name": "tiny-gpt2", "engine": "decoder", "path": "builtin:tiny-gpt2", "cpu_threads": 1,
    "generation": {"max_num_seqs": 2, "max_model_len": 128, "max_tokens_default": 4},
}  # fmt: skip


class Walk:
    """The aserve files with a frame while ``recording`` (on any thread)."""

    def __init__(self) -> None:
        self.recording = False
        self.files: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.recording and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE) and not _in_background(frame):
                self.files.add(name[len(PACKAGE) :])

    async def follow(self, request: Callable[[], Awaitable[None]]) -> set[str]:
        await request()  # warm: first-use imports and caches are not the path
        self.files.clear()
        sys.setprofile(self)
        self.recording = True
        try:
            await request()
        finally:
            self.recording = False
            sys.setprofile(None)
        return set(self.files)


@pytest.fixture
def walk() -> Any:
    recorder = Walk()
    threading.setprofile(recorder)  # the executor threads started from here on
    yield recorder
    threading.setprofile(None)  # type: ignore[arg-type]


async def test_one_unary_http_inference(walk: Walk, model_dir: Path) -> None:
    entry = model_entry(
        "affine", "affine.pt", [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])],
        batching={"max_batch_size": 8, "timeout_ms": 10000},
    )  # fmt: skip
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]
    }
    async with in_process({"models": [entry]}, model_dir) as srv, aiohttp.ClientSession() as s:

        async def infer() -> None:
            async with s.post(f"{srv.base}/v2/models/affine/infer", json=body) as r:
                assert r.status == 200, await r.text()
                assert len((await r.json())["outputs"][0]["data"]) == 16

        files = await walk.follow(infer)
    assert len(files) <= MAX_UNARY_INFER_FILES, sorted(files)


async def test_one_streamed_chat_completion(walk: Walk, tmp_path: Path) -> None:
    body = {
        "model": "tiny-gpt2",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
    }
    async with in_process({"models": [TINY_GPT2]}, tmp_path) as srv:
        async with aiohttp.ClientSession() as s:

            async def chat() -> None:
                async with s.post(f"{srv.base}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    text = await r.text()
                    assert text.rstrip().endswith("data: [DONE]"), text

            files = await walk.follow(chat)
    assert len(files) <= MAX_STREAMED_CHAT_FILES, sorted(files)
