"""``aserve archive DIR -o NAME.aserve``: test a project, then pack it into one file.

The project's tests run first (pytest, in the project's folder); an archive
is written only when they pass. It holds every plain file of the project but
caches and hidden files, plus ``MANIFEST.json`` (see ``aserve/config/archive.py``,
which checks it on load). Members are sorted and dated 1980, so packing the
same files twice gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from importlib.util import find_spec
from pathlib import Path

from aserve import __version__
from aserve.config import ConfigError, archive, read_config
from aserve.config.paths import PREFIX
from aserve.engines.checks import check_model_files

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".git", ".venv", "venv", ".mypy_cache", ".ruff_cache"}
_DATE = (1980, 1, 1, 0, 0, 0)


class PackError(Exception):
    """A project that cannot be packed; ``status`` is the exit status to give."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def project_files(project: Path, skip: Path | None = None) -> list[str]:
    """The project's members, '/'-separated and sorted: plain files, no caches or
    hidden files, no archives. A symlink is refused: an archive holds no links."""
    members = []
    for folder, dirs, files in os.walk(project):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for d in dirs:
            if (Path(folder) / d).is_symlink():
                raise PackError(f"{Path(folder) / d} is a symlink; an archive holds plain files")
        for f in files:
            path = Path(folder) / f
            if f.startswith(".") or f.endswith((".pyc", archive.SUFFIX)) or path == skip:
                continue
            if not stat.S_ISREG(path.lstat().st_mode):
                raise PackError(
                    f"{path} is not a plain file (a symlink?); an archive holds plain files"
                )
            name = path.relative_to(project).as_posix()
            why = archive.check_member_name(name)
            if why:
                raise PackError(f"{path}: an archive member's name {why}; rename it")
            members.append(name)
    return sorted(members)


def check_project(project: Path, config_name: str) -> None:
    """The project's config is valid, its handlers import and its model files lie inside it."""
    config_path = project / config_name
    if not config_path.is_file():
        raise PackError(f"{config_path}: no such config in the project")
    try:
        config, base_dir, _ = read_config(config_path)
        check_model_files(config, base_dir)
    except ConfigError as exc:
        raise PackError(str(exc)) from None
    for i, m in enumerate(config.models):
        if m.path is None or m.path.startswith(PREFIX):
            continue
        if not (m.folder(base_dir) / m.path).resolve().is_relative_to(project.resolve()):
            raise PackError(f"models[{i}].path: {m.path!r} is outside the project {project}")


def run_tests(project: Path) -> None:
    """pytest in the project's folder; raises :class:`PackError` unless its tests pass."""
    if find_spec("pytest") is None:
        raise PackError(
            "pytest is not installed, and the project's tests run before it is packed: "
            "pip install 'aserve[archive]', or pass --skip-tests to pack it untested"
        )
    print(f"aserve archive: running the tests of {project} (pytest)", flush=True)
    rc = subprocess.call(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project
    )
    if rc == 5:
        raise PackError(
            f"{project} has no tests for pytest to run; add some, or pass --skip-tests", 1
        )
    if rc != 0:
        raise PackError(
            f"the tests of {project} failed (pytest exit status {rc}); nothing written", 1
        )


def write_archive(project: Path, output: Path, config_name: str) -> dict:
    """Pack ``project`` into ``output`` (written beside, then renamed); returns the manifest."""
    names = project_files(project, skip=output.absolute())
    if config_name not in names:
        raise PackError(f"{project / config_name}: the config must be a plain file in the project")
    members = []
    for name in names:
        data = (project / name).read_bytes()
        members.append(
            {"path": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        )
    manifest = {"format": archive.FORMAT, "aserve_version": __version__, "config": config_name,
                "members": members}  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in [*names, archive.MANIFEST]:
                info = zipfile.ZipInfo(name, _DATE)
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                if name == archive.MANIFEST:
                    zf.writestr(info, json.dumps(manifest, indent=1) + "\n")
                else:
                    with open(project / name, "rb") as src, zf.open(info, "w") as dst:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise
    _warn_if_refused(output)
    return manifest


def _warn_if_refused(output: Path) -> None:
    """Say so when a server with the default limits would refuse the archive (a member
    that compresses past the ratio, say): it is written all the same, for a server
    whose config raises them."""
    try:
        archive.peek_config(output)
    except archive.ArchiveError as exc:
        print(f"aserve archive: warning: a server with the default limits refuses it: {exc}",
              file=sys.stderr)  # fmt: skip


def run_archive(project: Path, output: Path | None, config_name: str, skip_tests: bool) -> int:
    """The ``archive`` command: exit status 0; 1 when the tests fail; 2 for a bad project."""
    output = output or Path(f"{project.absolute().name}{archive.SUFFIX}")
    try:
        if not output.name.endswith(archive.SUFFIX) or output.name == archive.SUFFIX:
            raise PackError(f"-o {output}: an archive's name ends in {archive.SUFFIX}")
        if not project.is_dir():
            raise PackError(f"{project}: not a folder")
        check_project(project, config_name)
        if not skip_tests:
            run_tests(project)
        manifest = write_archive(project, output, config_name)
    except PackError as exc:
        print(f"aserve archive: error: {exc}", file=sys.stderr)
        return exc.status
    except OSError as exc:
        print(f"aserve archive: error: {exc}", file=sys.stderr)
        return 2
    size = sum(m["size"] for m in manifest["members"])
    print(f"wrote {output}: {len(manifest['members'])} files, {size} bytes (MANIFEST.json records "
          "each one's SHA-256)")  # fmt: skip
    return 0
