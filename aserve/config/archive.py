"""Serving ``.aserve`` archives: checked against their manifest, extracted once, reused.

An archive (made by ``aserve archive``, see ``aserve/commands/archive_pack.py``) is a zip
of a project plus ``MANIFEST.json``: every other member's path, SHA-256 and
size, the aserve version that packed it and the config file's name. Loading
checks the zip against the manifest before anything is written (integrity,
not signing: whoever can write the archive can write its manifest), then
extracts it into ``$ASERVE_CACHE_DIR/archives/<sha256 of the archive>/``.

Refused, naming the member: a path that escapes the archive's root (absolute,
``..``, a symlink, anything but a plain file), a member missing from the zip
or from the manifest, one whose bytes or size differ from the manifest, and
an extracted total over ``ASERVE_ARCHIVE_MAX_BYTES`` (counted while
decompressing, so a zip bomb's headers cannot lie about it).

Several processes may serve one archive at once: each extracts into a folder
of its own and renames it into place; a directory rename is atomic, so the
folder under the archive's hash is whole or absent. A folder already there is
reused once its files match the manifest again.

Nothing here unpickles: the manifest and the config are JSON, and the model
files inside are loaded by their engines as any other (TorchScript, exported
programs, ONNX). Blocking (hashing, extracting): call off the loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import IO, Any

from aserve.config.paths import PREFIX, cache_dir

MANIFEST = "MANIFEST.json"
FORMAT = 1
SUFFIX = ".aserve"
MAX_MEMBERS = 10_000
MAX_MANIFEST_BYTES = 16 << 20
DEFAULT_MAX_BYTES = 16 << 30  # the extracted total; ASERVE_ARCHIVE_MAX_BYTES overrides
_CHUNK = 1 << 20
# What an archive's model gives; a config entry naming the archive may not.
ARCHIVE_KEYS = ("engine", "handler", "inputs", "outputs", "steps", "root")


class ArchiveError(Exception):
    """An archive that cannot be served; the message names the archive and the member."""


def max_bytes() -> int:
    """The bound on an archive's extracted total (``ASERVE_ARCHIVE_MAX_BYTES``)."""
    raw = os.environ.get("ASERVE_ARCHIVE_MAX_BYTES")
    if raw is None:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ArchiveError(f"ASERVE_ARCHIVE_MAX_BYTES: {raw!r} is not a positive number of bytes")
    return value


def check_member_name(name: str) -> str | None:
    """Why ``name`` cannot be a member's path (None: it can): it must be relative,
    '/'-separated, and stay inside the archive's root."""
    if not name or "\x00" in name or "\\" in name:
        return "is not a plain relative path"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path (outside the archive's root)"
    parts = name.split("/")
    if ".." in parts:
        return "climbs out of the archive's root ('..')"
    if any(p in ("", ".") for p in parts):
        return "is not a plain relative path (empty or '.' part, or a directory)"
    return None


def serve_config(path: Path) -> dict[str, Any]:
    """The config of archive ``path``, extracted (or reused) in the cache and verified.

    Every model gets ``root``: the extracted folder, which its ``path`` and
    ``handler`` resolve against; paths in the config are made absolute.
    Raises :class:`ArchiveError`.
    """
    path = Path(path)
    try:
        f = open(path, "rb")  # held open: hashed, then read as a zip
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read archive: {exc.strerror}") from None
    with f:
        # One open file for the hash and the zip: a file replaced meanwhile cannot mix in.
        digest = _sha256(f)
        f.seek(0)
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ArchiveError(f"{path}: not a zip archive ({exc})") from None
        with zf:
            manifest = _verified_manifest(zf, path)
            root = (cache_dir() / "archives" / digest).absolute()
            if not (root.is_dir() and _extracted_ok(root, manifest)):
                _extract_into_place(zf, manifest, root, path)
    return _resolved_config(root, manifest["config"], path)


def _sha256(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _verified_manifest(zf: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    """The manifest, once the zip's members and it agree; raises naming the member."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS + 1:
        raise ArchiveError(f"{path}: {len(infos)} members (the limit is {MAX_MEMBERS})")
    by_name: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        why = check_member_name(name)
        if why:
            raise ArchiveError(f"{path}: member {name!r} {why}; refused")
        # Unix file type bits, where the packer set them (many leave them 0: a file).
        kind = stat.S_IFMT(info.external_attr >> 16)
        if (kind and kind != stat.S_IFREG) or info.is_dir():
            raise ArchiveError(f"{path}: member {name!r} is not a regular file (a symlink?)")
        if name in by_name:
            raise ArchiveError(f"{path}: member {name!r} appears twice")
        by_name[name] = info
    manifest = _read_manifest(zf, by_name.pop(MANIFEST, None), path)
    listed = {m["path"]: m for m in manifest["members"]}
    for name in listed:
        if name not in by_name:
            raise ArchiveError(f"{path}: member {name!r} is in {MANIFEST} but not in the archive")
    for name, info in by_name.items():
        if name not in listed:
            raise ArchiveError(f"{path}: member {name!r} is not in {MANIFEST}; refused")
        if info.file_size != listed[name]["size"]:
            raise ArchiveError(
                f"{path}: member {name!r} is {info.file_size} bytes; {MANIFEST} says "
                f"{listed[name]['size']} (tampered or corrupt)"
            )
    limit, total = max_bytes(), 0
    for m in manifest["members"]:
        total += m["size"]
        if total > limit:
            raise ArchiveError(
                f"{path}: member {m['path']!r} ({m['size']} bytes) takes the extracted total "
                f"over the limit of {limit} bytes (ASERVE_ARCHIVE_MAX_BYTES)"
            )
    if manifest["config"] not in listed:
        raise ArchiveError(f"{path}: its config {manifest['config']!r} is not a member")
    return manifest


def _read_manifest(zf: zipfile.ZipFile, info: zipfile.ZipInfo | None, path: Path) -> dict[str, Any]:
    if info is None:
        raise ArchiveError(f"{path}: no {MANIFEST}; not an aserve archive")
    if info.file_size > MAX_MANIFEST_BYTES:
        raise ArchiveError(f"{path}: {MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        with zf.open(info) as f:
            manifest = json.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (ValueError, zipfile.BadZipFile, OSError) as exc:
        raise ArchiveError(f"{path}: {MANIFEST} is unreadable: {exc}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise ArchiveError(f"{path}: {MANIFEST}: {problem}")
    return manifest  # type: ignore[no-any-return]


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"not an aserve manifest of format {FORMAT}"
    if not isinstance(manifest.get("config"), str) or not isinstance(manifest.get("members"), list):
        return "needs 'config' (a member's path) and 'members' (a list)"
    for m in manifest["members"]:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("path"), str)
            and isinstance(m.get("sha256"), str)
            and isinstance(m.get("size"), int)
            and m["size"] >= 0
        ):
            return f"member entry {m!r} needs 'path', 'sha256' and 'size'"
        why = check_member_name(m["path"])
        if why or m["path"] == MANIFEST:
            return f"member {m['path']!r} {why or 'is the manifest itself'}; refused"
    return None


def _extracted_ok(root: Path, manifest: dict[str, Any]) -> bool:
    """Whether a folder extracted before still holds every member unchanged."""
    for m in manifest["members"]:
        target = root / m["path"]
        try:
            st = target.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != m["size"]:
                return False
            with open(target, "rb") as f:
                if _sha256(f) != m["sha256"]:
                    return False
        except OSError:
            return False
    return True


def _extract_into_place(
    zf: zipfile.ZipFile, manifest: dict[str, Any], root: Path, path: Path
) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.{os.getpid()}.", dir=root.parent))
    try:
        for m in manifest["members"]:
            _extract_member(zf, m, tmp, path)
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700
        for _attempt in range(3):
            try:
                os.rename(tmp, root)  # atomic; fails while another folder is there
                return
            except OSError:
                pass
            if root.is_dir() and _extracted_ok(root, manifest):
                return  # another process extracted it first
            # A stale or damaged folder: moved aside (atomically), then removed.
            aside = Path(tempfile.mkdtemp(prefix=f".stale.{root.name}.", dir=root.parent))
            with contextlib.suppress(OSError):
                os.rename(root, aside / "x")
            shutil.rmtree(aside, ignore_errors=True)
        raise ArchiveError(f"{path}: cannot put the extracted archive in place at {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract_member(zf: zipfile.ZipFile, m: dict[str, Any], into: Path, path: Path) -> None:
    name, size = m["path"], m["size"]
    target = into / name
    target.parent.mkdir(parents=True, exist_ok=True)
    h, written = hashlib.sha256(), 0
    try:
        with zf.open(name) as src, open(target, "xb") as dst:
            # Never more than the manifest's size (+1 to see that there is more).
            while chunk := src.read(min(_CHUNK, size + 1 - written)):
                written += len(chunk)
                if written > size:
                    raise ArchiveError(
                        f"{path}: member {name!r} holds more than its {size} bytes; refused"
                    )
                h.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ArchiveError(f"{path}: member {name!r} is corrupt: {exc}") from None
    if written != size or h.hexdigest() != m["sha256"]:
        raise ArchiveError(
            f"{path}: member {name!r} does not match its SHA-256 in {MANIFEST} (tampered or "
            "corrupt); refused"
        )


def _resolved_config(root: Path, config_name: str, path: Path) -> dict[str, Any]:
    try:
        config = json.loads((root / config_name).read_bytes())
    except ValueError as exc:
        raise ArchiveError(f"{path}: its config {config_name!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ArchiveError(f"{path}: its config {config_name!r} is not a JSON object")
    models = config.get("models", [])
    for i, m in enumerate(models if isinstance(models, list) else []):
        if not isinstance(m, dict):
            continue
        p = m.get("path")
        if isinstance(p, str) and not p.startswith(PREFIX):
            m["path"] = str(_inside(root, p, f"models[{i}].path", path))
        m["root"] = str(root)
    return config


def _inside(root: Path, rel: str, where: str, path: Path) -> Path:
    """``root / rel``, which must stay inside the extracted archive."""
    target = (root / rel).resolve()
    if not target.is_relative_to(root.resolve()) or PurePosixPath(rel).is_absolute():
        raise ArchiveError(f"{path}: its config's {where} {rel!r} is outside the archive")
    return target


def expand_entry(entry: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A config's model entry whose ``path`` is an archive, as the archive's one model.

    The entry's other keys (``name``, ``version``, ``device``, ``instances``,
    ``batching``, ...) replace the archive model's; those that define the model
    (:data:`ARCHIVE_KEYS`) come from the archive only. Raises :class:`ArchiveError`.
    """
    given = [k for k in ARCHIVE_KEYS if k in entry]
    if given:
        raise ArchiveError(
            f"the archive {entry['path']!r} gives {', '.join(given)}; remove it from this entry"
        )
    config = serve_config(base_dir / entry["path"])
    models = config.get("models")
    if not isinstance(models, list) or len(models) != 1 or not isinstance(models[0], dict):
        count = len(models) if isinstance(models, list) else 0
        raise ArchiveError(
            f"archive {entry['path']!r} has {count} models; a config entry serves an "
            "archive of exactly one"
        )
    model = dict(models[0])
    model.pop("path", None)
    model.update({k: v for k, v in entry.items() if k != "path"})
    if "path" in models[0]:
        model["path"] = models[0]["path"]
    return model
