"""``aserve new NAME``: a handler project to start from, whose own tests pass.

The templates are package data (``aserve/templates/project``); ``{{name}}``
in them is the project's name, which is also its model's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
# project file -> template
FILES = {
    "handler.py": "handler.py.tmpl",
    "config.json": "config.json.tmpl",
    "client.py": "client.py.tmpl",
    "requirements.txt": "requirements.txt.tmpl",
    "tests/test_handler.py": "test_handler.py.tmpl",
}


class ScaffoldError(Exception):
    """A project that cannot be created here; says why."""


def create_project(target: Path, name: str) -> list[Path]:
    """Write a project named ``name`` into ``target`` (absent or an empty folder).

    The files are written into a folder beside and renamed into place, so an
    interrupted run leaves no half project. Raises :class:`ScaffoldError`.
    """
    if not NAME.match(name):
        raise ScaffoldError(
            f"{name!r} is not a project name: a letter or '_' first, then letters, digits, "
            "'_' or '-' (at most 64)"
        )
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ScaffoldError(f"{target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()):
        raise ScaffoldError(f"{target} exists and is not empty; choose another name")
    templates = resources.files("aserve") / "templates" / "project"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        for rel, template in FILES.items():
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text((templates / template).read_text().replace("{{name}}", name))
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700
        try:
            os.rename(tmp, target)  # onto an empty folder too; atomic
        except OSError as exc:
            raise ScaffoldError(f"cannot create {target}: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [target / rel for rel in FILES]


def run_new(name: str) -> int:
    """The ``new`` command: exit status 0, or 2 with a message."""
    target = Path.cwd() / name
    try:
        create_project(target, name)
    except ScaffoldError as exc:
        print(f"aserve new: error: {exc}", file=sys.stderr)
        return 2
    print(next_steps(name))
    return 0


def next_steps(name: str) -> str:
    """What to run next, with the interpreter that ran ``aserve new`` (a bare
    ``python`` or ``aserve`` may not be the one aserve is installed in, e.g. a
    virtualenv that is not activated), and what pytest needs when it is missing."""
    py = shlex.quote(sys.executable)
    folder = shlex.quote(name)
    lines = [
        f"created {name}/: handler.py, config.json, client.py, requirements.txt, "
        "tests/test_handler.py",
        f"  cd {folder} && {py} -m pytest -q  # its tests: the real server, real clients",
        f"  {py} -m aserve --config {folder}/config.json  # serve it",
        f"  {py} -m aserve archive {folder} -o {folder}.aserve  # test and pack it",
    ]
    if importlib.util.find_spec("pytest") is None:
        lines.append(
            f"the tests and aserve archive need pytest, which {py} lacks: "
            f"{py} -m pip install 'aserve[archive]'"
        )
    return "\n".join(lines)
