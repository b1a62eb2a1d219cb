"""Helpers for tests that pack, rewrite and serve ``.aserve`` archives."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from aserve.config import archive

REPO = Path(__file__).resolve().parent.parent
ROWS = [5.1, 3.5, 1.4, 0.2, 6.0, 2.9, 4.5, 1.5, 6.3, 3.3, 6.0, 2.5]  # setosa, versicolor, virginica


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def aserve(
    *args: str, cwd: Path, timeout: float = 300, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``python -m aserve *args`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env(**extra),
    )  # fmt: skip


def scaffold(folder: Path, name: str = "demo") -> Path:
    """``aserve new NAME`` in ``folder``: the scaffold's project."""
    made = aserve("new", name, cwd=folder)
    assert made.returncode == 0, made.stderr
    return folder / name


def pack(project: Path, output: Path) -> Path:
    """``aserve archive PROJECT -o OUTPUT --skip-tests``."""
    done = aserve("archive", str(project), "-o", str(output), "--skip-tests", cwd=output.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return output


def relabelled(project: Path, folder: Path, label: str) -> Path:
    """A copy of the scaffold whose handler names the first class ``label``."""
    other = folder / f"{project.name}-{label}"
    shutil.copytree(project, other, ignore=shutil.ignore_patterns("__pycache__"))
    handler = other / "handler.py"
    source = handler.read_text()
    assert '"setosa"' in source
    handler.write_text(source.replace('"setosa"', f'"{label}"'))
    return other


def listed(manifest: dict, name: str, data: bytes) -> None:
    """Add member ``name`` with ``data`` to ``manifest`` (it then agrees with the zip)."""
    manifest["members"].append(
        {"path": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    )


def rebuild(
    src: Path,
    dst: Path,
    change: Callable[[dict[str, bytes], dict], None],
    modes: dict[str, int] | None = None,
) -> Path:
    """``src`` rewritten: ``change(members, manifest)`` edits the member bytes and the
    manifest in place; ``modes`` gives members a file type (a symlink)."""
    with zipfile.ZipFile(src) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if n != archive.MANIFEST}
        manifest = json.loads(zf.read(archive.MANIFEST))
    change(members, manifest)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (modes or {}).get(name, stat.S_IFREG | 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
        zf.writestr(archive.MANIFEST, json.dumps(manifest))
    return dst


def with_files(src: Path, dst: Path, files: dict[str, bytes]) -> Path:
    """``src`` with members ``files`` written (replaced or added), its manifest agreeing:
    an archive the packer would not write (its handler's import never returns, say)."""

    def change(members: dict[str, bytes], manifest: dict) -> None:
        for name, data in files.items():
            members[name] = data
            manifest["members"] = [m for m in manifest["members"] if m["path"] != name]
            listed(manifest, name, data)

    return rebuild(src, dst, change)


def swap_in(src: Path, dst: Path) -> None:
    """Replace ``dst`` in one step, as a deploy does (write beside, rename)."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def folders(cache: Path) -> list[str]:
    """The archive cache's folders (digests), without the lock files beside them."""
    base = cache / "archives"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.suffix != ".lock")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
