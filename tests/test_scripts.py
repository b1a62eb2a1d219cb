"""scripts/setup: runtime or dev install, and no pip at all when up to date.

The script runs on a copy of what it reads, with a ``.venv/bin/python`` that
only logs how it was called (and succeeds): each pip call is seen, nothing is
installed. The shim answers the script's probe of PyTorch's CPU index too, so
torch comes from that index, as on a machine that reaches it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
SETUP = (REPO / "scripts" / "setup").read_text()
TORCH = re.search(r'^TORCH="(torch==[^"]+)"$', SETUP, re.M).group(1)  # type: ignore[union-attr]
CPU_INDEX = re.search(r'^CPU_INDEX="([^"]+)"$', SETUP, re.M).group(1)  # type: ignore[union-attr]
TORCH_CALL = f"-m pip install -q --extra-index-url {CPU_INDEX} {TORCH}"
RUNTIME = [TORCH_CALL, "-m pip install -q -e ."]
DEV = [TORCH_CALL, "-m pip install -q -e .[dev]"]


class Checkout:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "scripts").mkdir(parents=True)
        shutil.copy(REPO / "scripts" / "setup", root / "scripts" / "setup")
        shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
        self.log = root / "pip-calls"
        self.log.touch()
        shim = root / ".venv" / "bin" / "python"
        shim.parent.mkdir(parents=True)
        shim.write_text(f'#!/bin/sh\necho "$*" >> {self.log}\n')
        shim.chmod(0o755)

    def setup(self, *args: str) -> tuple[list[str], str]:
        """Run scripts/setup; returns the pip calls it made and what it printed."""
        before = self.log.read_text().splitlines()
        result = subprocess.run(
            [str(self.root / "scripts" / "setup"), *args],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, "PYTHON": sys.executable},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        calls = self.log.read_text().splitlines()[len(before) :]
        return [c for c in calls if c.startswith("-m pip")], result.stderr


def test_setup_installs_once_per_kind_and_skips_pip_when_up_to_date(tmp_path):
    repo = Checkout(tmp_path / "repo")
    calls, said = repo.setup()
    assert calls == RUNTIME and "runtime dependencies" in said
    assert repo.setup() == ([], "")  # up to date: no pip, nothing printed
    # A test setup after a serve setup installs the dev tools ...
    calls, said = repo.setup("--dev")
    assert calls == DEV and "dev tools" in said
    assert repo.setup("--dev") == ([], "")
    # ... and a serve setup after it needs nothing (the dev install includes the runtime).
    assert repo.setup() == ([], "")
    # A change to pyproject.toml: each kind installs again, once.
    with open(repo.root / "pyproject.toml", "a") as f:
        f.write("# changed\n")
    assert repo.setup()[0] == RUNTIME
    assert repo.setup()[0] == []
    assert repo.setup("--dev")[0] == DEV
    assert repo.setup("--dev")[0] == []


def test_the_torch_pin_is_the_cpu_build():
    # "+cpu" exists only as the CPU build: no index can resolve it to a CUDA one.
    assert TORCH.endswith("+cpu"), TORCH


def test_serve_sets_up_the_runtime_kind_and_test_the_dev_kind():
    # scripts/serve sets up the runtime kind; scripts/test the dev kind.
    assert "scripts/setup\n" in (REPO / "scripts" / "serve").read_text()
    assert "scripts/setup --dev\n" in (REPO / "scripts" / "test").read_text()
