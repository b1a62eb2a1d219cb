"""The built wheel carries everything the server needs.

The slow test builds the wheel, installs it with torch (nothing else) into a
fresh venv, and serves the default model from an empty folder: what a user
who runs ``pip install aserve-*.whl`` then ``aserve`` gets. Deselect it with
``-m "not slow"``; CI runs it. pip's cache is reused (no ``--no-cache-dir``).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers import v2_body

REPO = Path(__file__).resolve().parent.parent


def test_the_example_default_config_is_the_embedded_one():
    # configs/default.json is what the quick start shows; it links to the package's copy.
    example = REPO / "configs" / "default.json"
    assert example.read_bytes() == (REPO / "aserve" / "default_config.json").read_bytes()


def test_the_quick_start_names_every_extra():
    """The wheel section's list of extras (docs/getting-started.md) is the package's (the
    dev tools aside)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    named = set(extras["optional-dependencies"]) - {"dev"}
    page = (REPO / "docs" / "getting-started.md").read_text()
    m = re.search(r"^Extras: (.*?)\.$", page, re.M | re.S)
    assert m, "the quick start's list of extras is gone"
    assert set(re.findall(r"`(?:aserve)?\[(\w+)\]`", m.group(1))) == named


def _torch_pin() -> str:
    """The torch the setup pins (one place: scripts/setup)."""
    m = re.search(r'^TORCH="(torch==[^"]+)"$', (REPO / "scripts" / "setup").read_text(), re.M)
    assert m, "scripts/setup pins no torch"
    return m.group(1)


def _run(argv: list[str], timeout: float, **kw) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_in_a_fresh_venv_serves_the_default_model(tmp_path):
    # Build from a copy of what the wheel is made of: the checkout stays clean.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "aserve", src / "aserve", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist")]
    if _has("setuptools"):
        build.append("--no-build-isolation")  # the setuptools here; else pip fetches one
    _run([*build, str(src)], 300, env=env)
    (wheel,) = (tmp_path / "dist").glob("aserve-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120, env=env)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", _torch_pin(), str(wheel)], 600, env=env)

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    proc = subprocess.Popen(
        [str(venv / "bin" / "aserve"), "--port", "0"],
        cwd=empty, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**env, "PYTHONUNBUFFERED": "1", "ASERVE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "ready: 1 model(s) serving" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.05):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        log = "".join(lines)
        # The installed package's own default config, not the checkout's.
        assert f"starting with {venv}" in log and "default_config.json" in log, log
        port = int(re.search(r"listening on http://[^:]+:(\d+)", log).group(1))
        x = np.arange(16, dtype=np.float32)

        async def call() -> tuple[int, dict]:
            url = f"http://127.0.0.1:{port}/v2/models/affine/infer"
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json=v2_body("INPUT0", x.tolist(), [1, 16])) as r:
                    return r.status, await r.json()

        status, body = asyncio.run(call())
        assert status == 200, body
        import torch

        from aserve.engines.builtin import affine

        want = affine()(torch.from_numpy(x[None])).detach().numpy().ravel()
        np.testing.assert_allclose(body["outputs"][0]["data"], want, rtol=1e-5, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
