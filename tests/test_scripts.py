"""scripts/setup: runtime or dev install, and no pip at all when up to date.

The script runs on a copy of what it reads, with a ``.venv/bin/python`` that
only logs how it was called: each pip call is seen, nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
RUNTIME = [f"-m pip install -q {TORCH}", "-m pip install -q -e ."]
DEV = [f"-m pip install -q {TORCH}", "-m pip install -q -e .[dev]"]


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
        return self.log.read_text().splitlines()[len(before) :], result.stderr


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


def test_serve_sets_up_the_runtime_kind_and_test_the_dev_kind():
    # scripts/serve sets up the runtime kind; scripts/test the dev kind.
    assert "scripts/setup\n" in (REPO / "scripts" / "serve").read_text()
    assert "scripts/setup --dev\n" in (REPO / "scripts" / "test").read_text()
