"""Helpers for tests that change a running server's config."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

HANDLERS = Path(__file__).parent / "handlers"


def rewrite_config(path: Path, config: dict[str, Any]) -> str:
    """Replace the config file in one step (write beside, rename); returns its hash.
    ``drain_grace_s`` is 0 unless ``config`` says otherwise (see conftest.write_config)."""
    raw = json.dumps({"drain_grace_s": 0, **config}, indent=2).encode()
    return rewrite_raw(path, raw)


def rewrite_raw(path: Path, raw: bytes) -> str:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def config_status(base: str) -> dict[str, Any]:
    status, doc = get_json(f"{base}/v2/config/status")
    assert status == 200, doc
    return doc


def wait_status(base: str, check: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Poll ``/v2/config/status`` until ``check(status)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        doc = config_status(base)
        if check(doc):
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"config status never reached the condition; last: {doc}")
        time.sleep(0.02)


def wait_attempts(base: str, before: dict[str, int], timeout: float = 30.0) -> dict[str, Any]:
    """Wait until one more reload attempt than ``before`` (status["reloads"]) is recorded."""
    total = sum(before.values())
    return wait_status(base, lambda s: sum(s["reloads"].values()) > total, timeout)


def copy_handler(folder: Path, module: str = "text_tokenizer") -> None:
    shutil.copy(HANDLERS / f"{module}.py", folder / f"{module}.py")


def wait_log(server: Any, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never logged:\n{server.log_text()}")
        time.sleep(0.02)
