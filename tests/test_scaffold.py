"""``aserve new``: the scaffold's own tests pass out of the box; bad targets are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def aserve(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env(),
    )  # fmt: skip


def _env() -> dict[str, str]:
    # This checkout's aserve, in the subprocess and in the servers its tests start.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@pytest.mark.timeout(300)
def test_a_new_project_passes_its_own_tests(tmp_path: Path) -> None:
    made = aserve("new", "demo", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    project = tmp_path / "demo"
    for name in (
        "handler.py",
        "config.json",
        "client.py",
        "requirements.txt",
        "tests/test_handler.py",
    ):
        assert (project / name).is_file(), name
    assert '"name": "demo"' in (project / "config.json").read_text()
    # Its tests start the real server on the project and ask it with real clients,
    # run as the command printed says, from where `aserve new` ran.
    printed = made.stdout.splitlines()
    [test_line] = [line for line in printed if "-m pytest" in line]
    command = test_line.split("  #")[0].strip()
    assert command.startswith("cd demo && ") and sys.executable in command, printed
    run = subprocess.run(
        command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env=_env(),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 passed" in run.stdout, run.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["a b", "../up", "9lives", "x/y", "", "-flag", "a" * 65])
def test_a_bad_name_is_refused(tmp_path: Path, name: str) -> None:
    made = aserve("new", "--", name, cwd=tmp_path)
    assert made.returncode == 2
    assert "is not a project name" in made.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_an_existing_target_is_refused_unless_empty(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    made = aserve("new", "full", cwd=tmp_path)
    assert made.returncode == 2
    assert "exists and is not empty" in made.stderr
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "afile").write_text("")
    made = aserve("new", "afile", cwd=tmp_path)
    assert made.returncode == 2 and "is not a folder" in made.stderr
    (tmp_path / "empty").mkdir()
    made = aserve("new", "empty", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "empty" / "handler.py").is_file()
    # No folder of the half-written kind is left beside.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty", "full"]


@pytest.mark.timeout(60)
def test_no_arguments_and_config_still_serve_as_before(tmp_path: Path) -> None:
    # The subcommands leave the top-level options alone: --help lists both.
    helped = aserve("--help", cwd=tmp_path)
    assert helped.returncode == 0
    assert "--config" in helped.stdout and "new" in helped.stdout and "archive" in helped.stdout
    bad = aserve("--config", str(tmp_path / "missing.json"), cwd=tmp_path)
    assert bad.returncode == 2 and "cannot read config" in bad.stderr
