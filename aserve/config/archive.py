"""Serving ``.aserve`` archives: checked from the zip's directory and their manifest,
extracted once per content into the cache (:mod:`aserve.config.archive_cache`).

An archive (made by ``aserve archive``, see ``aserve/commands/archive_pack.py``) is a zip
of a project plus ``MANIFEST.json``: every other member's path, SHA-256 and
size, the aserve version that packed it and the config file's name. Loading
checks the zip against the manifest before anything is written (integrity,
not signing: whoever can write the archive can write its manifest), then
extracts it into ``$ASERVE_CACHE_DIR/archives/<sha256 of the archive>/``.

Refused, naming the archive and the member, before a byte is written:

- a zip whose directory declares more than :data:`MAX_MEMBERS` members or
  :data:`MAX_DIRECTORY_BYTES` (read from its end record, before ``zipfile``
  parses the directory);
- a member name that is not a plain relative path (absolute, ``..``, empty
  or ``.`` parts, a backslash, a NUL or another unprintable character), a
  part over :data:`MAX_PART_BYTES` bytes, a path over :data:`MAX_NAME_BYTES`
  bytes or :data:`MAX_DEPTH` parts, a name that is both a file and a folder
  (``a`` and ``a/b``), a name twice;
- anything but a plain file (a symlink, a folder entry), an encrypted member,
  one compressed other than stored or deflated;
- a member missing from the zip or from the manifest, one whose size differs;
- an extracted total over ``max_extracted_bytes``, a member that expands more
  than ``max_compression_ratio`` times its compressed size (members up to
  :data:`SMALL_MEMBER_BYTES` aside), members whose compressed sizes add up to
  more than the archive holds (overlapping members: a bomb that reuses its
  data), a total larger than the cache's free space.

While extracting, real bytes are counted too (the directory can lie): a
member that decompresses past its declared size, or to other bytes than its
SHA-256, is refused, and what was written is removed. So what an archive
writes is at most its declared total, and at most the ratio times its own size.

Nothing here unpickles: the manifest and the config are JSON (``orjson``, which
refuses nesting past 1024 levels), and the model files inside are loaded by
their engines as any other. Blocking (hashing, extracting): call off the loop.
"""

from __future__ import annotations

import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

import orjson

from aserve.config import archive_cache
from aserve.config.paths import PREFIX
from aserve.config.schema import ArchivesConfig

MANIFEST = "MANIFEST.json"
FORMAT = 1
SUFFIX = ".aserve"
MAX_MEMBERS = 10_000
MAX_DIRECTORY_BYTES = 32 << 20  # the zip's central directory (names, comments, extras)
MAX_MANIFEST_BYTES = 16 << 20
MAX_CONFIG_BYTES = 16 << 20  # the archive's config member, read into memory
MAX_PART_BYTES = 255  # one part of a member's path: a file system's NAME_MAX
MAX_NAME_BYTES = 1024  # a member's whole path
MAX_DEPTH = 32  # parts of a member's path
# Real models hold weights that barely compress (1-3x); code and JSON 3-10x. A
# member this small may compress better (4 KiB of zeros deflate to 20 bytes):
# a bomb of many such members writes at most MAX_MEMBERS of them, 40 MiB.
SMALL_MEMBER_BYTES = 4 << 10
DEFAULT_MAX_BYTES = 4 << 30  # the extracted total; archives.max_extracted_bytes overrides
DEFAULT_MAX_RATIO = 100.0  # archives.max_compression_ratio overrides
ENV_MAX_BYTES = "ASERVE_ARCHIVE_MAX_BYTES"  # the default of max_extracted_bytes, if set
_CHUNK = 1 << 20
_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
# What reading a damaged member can raise (zlib.error: bad deflate data).
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError)
# What an archive's model gives; a config entry naming the archive may not.
ARCHIVE_KEYS = ("engine", "handler", "inputs", "outputs", "steps", "root")
_HOW_TO_RAISE = "archives.{key} in the config, or aserve serve --{flag}"


class ArchiveError(Exception):
    """An archive that cannot be served; the message names the archive and the member."""


@dataclass(frozen=True)
class Limits:
    """What one archive may extract: its total and the expansion of each member."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_ratio: float = DEFAULT_MAX_RATIO


def limits_of(config: ArchivesConfig | None = None) -> Limits:
    """The limits a config's ``archives`` block sets; ``max_extracted_bytes`` left
    out is ``$ASERVE_ARCHIVE_MAX_BYTES``, else :data:`DEFAULT_MAX_BYTES`."""
    config = config or ArchivesConfig()
    max_bytes = config.max_extracted_bytes
    if max_bytes is None:
        max_bytes = _env_max_bytes()
    return Limits(max_bytes, config.max_compression_ratio)


def _env_max_bytes() -> int:
    raw = os.environ.get(ENV_MAX_BYTES)
    if raw is None:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ArchiveError(f"{ENV_MAX_BYTES}: {raw!r} is not a positive number of bytes")
    return value


def check_member_name(name: str) -> str | None:
    """Why ``name`` cannot be a member's path (None: it can): it must be relative,
    '/'-separated, printable, stay inside the archive's root, and fit a file system."""
    if not name or not name.isprintable() or "\\" in name:
        return "is not a plain relative path (empty, or a backslash or unprintable character)"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path (outside the archive's root)"
    parts = name.split("/")
    if ".." in parts:
        return "climbs out of the archive's root ('..')"
    if any(p in ("", ".") for p in parts):
        return "is not a plain relative path (empty or '.' part, or a directory)"
    try:
        encoded = name.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return "is not valid UTF-8"
    if len(encoded) > MAX_NAME_BYTES or len(parts) > MAX_DEPTH:
        return f"is longer than {MAX_NAME_BYTES} bytes or {MAX_DEPTH} folders deep"
    if any(len(p.encode()) > MAX_PART_BYTES for p in parts):
        return f"has a file or folder name over {MAX_PART_BYTES} bytes"
    return None


def serve_config(path: Path, limits: Limits | None = None) -> dict[str, Any]:
    """The config of archive ``path``, verified and extracted (or reused) in the cache.

    Every model gets ``root``: the extracted folder, which its ``path`` and
    ``handler`` resolve against; paths in the config are made absolute. This
    process holds the folder (no sweep removes it) until
    :func:`aserve.config.archive_cache.let_go` lets it go.
    Raises :class:`ArchiveError`.
    """
    return _read(Path(path), limits or limits_of(), extract=True)


def peek_config(path: Path, limits: Limits | None = None) -> dict[str, Any]:
    """:func:`serve_config` without extracting: the archive is checked as for
    serving, its config read from the zip alone; ``root`` is the folder it is
    extracted into when served (which need not exist yet)."""
    return _read(Path(path), limits or limits_of(), extract=False)


def _read(path: Path, limits: Limits, extract: bool) -> dict[str, Any]:
    with _open_archive(path) as f:
        size = os.fstat(f.fileno()).st_size
        _check_end_record(f, size, path)
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
            # ValueError: a name flagged UTF-8 that is not (UnicodeDecodeError)
            raise ArchiveError(f"{path}: not a zip archive ({exc})") from None
        with zf:
            manifest = _verified_manifest(zf, path, limits, size)
            config_raw = _read_member(zf, manifest, manifest["config"], MAX_CONFIG_BYTES, path)
            config = _parsed_config(config_raw, manifest["config"], path)  # before any write
            # One open file for the zip and the hash: a file replaced meanwhile cannot mix in.
            f.seek(0)
            root = archive_cache.folder(archive_cache.sha256(f))
            config = _resolved_config(root, config, path)
            if extract:
                _extract(zf, manifest, root, path)
    return config


@contextmanager
def _open_archive(path: Path) -> Iterator[IO[bytes]]:
    """The archive, opened only if it is a regular file (a FIFO would block the open,
    a device would read forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read archive: {exc.strerror}") from None
    except ValueError:  # a NUL in the path
        raise ArchiveError(f"{_cut(str(path))}: not a file name (a NUL in it)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArchiveError(f"{path}: not a regular file; an archive is a .aserve zip file")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"


def _check_end_record(f: IO[bytes], size: int, path: Path) -> None:
    """Refuse a directory too large to parse, from the zip's end record alone
    (``zipfile`` builds an object per member: 300,000 members took 1.8 s and 300 MB)."""
    tail_at = max(0, size - (22 + 0xFFFF))
    f.seek(tail_at)
    tail = f.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise ArchiveError(f"{path}: not a zip archive (no end of central directory record)")
    _, _, _, _, entries, dir_size, _, _ = struct.unpack("<4s4H2LH", tail[at : at + 22])
    locator = tail[at - 20 : at] if at >= 20 else b""
    if locator[:4] == _EOCD64_LOCATOR:  # zip64: the counts live in the zip64 record
        (offset,) = struct.unpack_from("<Q", locator, 8)
        f.seek(offset)
        record = f.read(56)
        if len(record) == 56 and record[:4] == _EOCD64:
            entries, dir_size = struct.unpack_from("<QQ", record, 32)
    if entries > MAX_MEMBERS + 1:
        raise ArchiveError(f"{path}: {entries} members (the limit is {MAX_MEMBERS})")
    if dir_size > MAX_DIRECTORY_BYTES:
        raise ArchiveError(
            f"{path}: its zip directory is {dir_size} bytes (the limit is {MAX_DIRECTORY_BYTES})"
        )


def _verified_manifest(
    zf: zipfile.ZipFile, path: Path, limits: Limits, archive_size: int
) -> dict[str, Any]:
    """The manifest, once the zip's members and it agree and the limits hold;
    raises naming the member."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS + 1:
        raise ArchiveError(f"{path}: {len(infos)} members (the limit is {MAX_MEMBERS})")
    by_name = _members(infos, path, archive_size)
    manifest = _read_manifest(zf, by_name.pop(MANIFEST, None), path)
    listed: dict[str, dict[str, Any]] = {}
    for m in manifest["members"]:
        if m["path"] in listed:
            raise ArchiveError(f"{path}: member {m['path']!r} is listed twice in {MANIFEST}")
        listed[m["path"]] = m
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
    total = 0
    for m in manifest["members"]:
        total += m["size"]
        if total > limits.max_bytes:
            raise ArchiveError(
                f"{path}: member {m['path']!r} ({m['size']} bytes) takes the extracted total "
                f"over the limit of {limits.max_bytes} bytes (raise it with "
                + _HOW_TO_RAISE.format(key="max_extracted_bytes", flag="max-archive-bytes")
                + ")"
            )
    for name, info in by_name.items():
        if info.file_size > max(SMALL_MEMBER_BYTES, limits.max_ratio * info.compress_size):
            raise ArchiveError(
                f"{path}: member {name!r} expands {info.file_size / max(1, info.compress_size):.0f}x "
                f"({info.compress_size} bytes to {info.file_size}), over the limit of "
                f"{limits.max_ratio:g}x (a zip bomb? raise it with "
                + _HOW_TO_RAISE.format(key="max_compression_ratio", flag="max-archive-ratio")
                + ")"
            )
    if manifest["config"] not in listed:
        raise ArchiveError(f"{path}: its config {manifest['config']!r} is not a member")
    return manifest


def _members(
    infos: list[zipfile.ZipInfo], path: Path, archive_size: int
) -> dict[str, zipfile.ZipInfo]:
    """The zip's members by name, each a plain file with a plain name."""
    by_name: dict[str, zipfile.ZipInfo] = {}
    compressed = 0
    for info in infos:
        name = info.filename
        why = check_member_name(name)
        if why:
            raise ArchiveError(f"{path}: member {_shown(name)} {why}; refused")
        # Unix file type bits, where the packer set them (many leave them 0: a file).
        kind = stat.S_IFMT(info.external_attr >> 16)
        if (kind and kind != stat.S_IFREG) or info.is_dir():
            raise ArchiveError(f"{path}: member {name!r} is not a regular file (a symlink?)")
        if info.flag_bits & 0x1:
            raise ArchiveError(f"{path}: member {name!r} is encrypted; refused")
        if info.compress_type not in _COMPRESSIONS:
            raise ArchiveError(
                f"{path}: member {name!r} is compressed with zip method {info.compress_type}; "
                "an archive's members are stored or deflated"
            )
        if name in by_name:
            raise ArchiveError(f"{path}: member {name!r} appears twice")
        by_name[name] = info
        compressed += info.compress_size
    if compressed > archive_size:
        raise ArchiveError(
            f"{path}: its members' compressed sizes add up to {compressed} bytes, more than "
            f"the archive's {archive_size} (members that overlap: a zip bomb?); refused"
        )
    for name in by_name:
        parts = name.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in by_name:
                raise ArchiveError(
                    f"{path}: member {folder!r} is a file, and member {name!r} needs a folder "
                    "of that name; refused"
                )
    return by_name


def _shown(name: str) -> str:
    """A member's name for a message: quoted, escaped, and cut if long."""
    text = ascii(name)
    return text if len(text) <= 120 else f"{text[:100]}...' ({len(name)} characters)"


def _read_manifest(zf: zipfile.ZipFile, info: zipfile.ZipInfo | None, path: Path) -> dict[str, Any]:
    if info is None:
        raise ArchiveError(f"{path}: no {MANIFEST}; not an aserve archive")
    if info.file_size > MAX_MANIFEST_BYTES:
        raise ArchiveError(f"{path}: {MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        with zf.open(info) as f:
            manifest = orjson.loads(f.read(MAX_MANIFEST_BYTES + 1))
    except (orjson.JSONDecodeError, *_READ_ERRORS) as exc:
        raise ArchiveError(f"{path}: {MANIFEST} is unreadable: {exc}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise ArchiveError(f"{path}: {MANIFEST}: {problem}")
    return manifest  # type: ignore[no-any-return]


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f'not an aserve manifest of format {FORMAT} (a JSON object with "format": 1)'
    if not isinstance(manifest.get("config"), str) or not isinstance(manifest.get("members"), list):
        return "needs 'config' (a member's path) and 'members' (a list)"
    if len(manifest["members"]) > MAX_MEMBERS:
        return f"lists {len(manifest['members'])} members (the limit is {MAX_MEMBERS})"
    for m in manifest["members"]:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("path"), str)
            and isinstance(m.get("sha256"), str)
            and type(m.get("size")) is int
            and m["size"] >= 0
        ):
            return f"member entry {_cut(m)} needs 'path', 'sha256' and 'size' (an integer)"
        why = check_member_name(m["path"])
        if why or m["path"] == MANIFEST:
            return f"member {_shown(m['path'])} {why or 'is the manifest itself'}; refused"
    return None


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def _read_member(
    zf: zipfile.ZipFile, manifest: dict[str, Any], name: str, limit: int, path: Path
) -> bytes:
    """One member's bytes, checked against the manifest (for the config, read from
    the zip whether or not the archive is extracted)."""
    m = next(m for m in manifest["members"] if m["path"] == name)
    if m["size"] > limit:
        raise ArchiveError(f"{path}: member {name!r} is over {limit} bytes")
    try:
        with zf.open(zf.getinfo(name)) as f:
            data = f.read(m["size"] + 1)
    except _READ_ERRORS as exc:
        raise ArchiveError(f"{path}: member {name!r} is corrupt: {exc}") from None
    if len(data) != m["size"] or archive_cache.sha256_bytes(data) != m["sha256"]:
        raise ArchiveError(
            f"{path}: member {name!r} does not match its SHA-256 in {MANIFEST} (tampered or "
            "corrupt); refused"
        )
    return data


def _extract(zf: zipfile.ZipFile, manifest: dict[str, Any], root: Path, path: Path) -> None:
    total = sum(m["size"] for m in manifest["members"])

    def extract_into(into: Path) -> None:
        for m in manifest["members"]:
            _extract_member(zf, m, into, path)

    try:
        archive_cache.use(root, total, lambda r: _extracted_ok(r, manifest), extract_into)
    except archive_cache.CacheError as exc:
        raise ArchiveError(f"{path}: {exc}") from None


def _extracted_ok(root: Path, manifest: dict[str, Any]) -> bool:
    """Whether a folder extracted before still holds every member unchanged."""
    for m in manifest["members"]:
        target = root / m["path"]
        try:
            st = target.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != m["size"]:
                return False
            with open(target, "rb") as f:
                if archive_cache.sha256(f) != m["sha256"]:
                    return False
        except OSError:
            return False
    return True


def _extract_member(zf: zipfile.ZipFile, m: dict[str, Any], into: Path, path: Path) -> None:
    name, size = m["path"], m["size"]
    target = into / name
    h, written = archive_cache.hasher(), 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(zf.getinfo(name)) as src, open(target, "xb") as dst:
            # Never more than the manifest's size (+1 to see that there is more).
            while chunk := src.read(min(_CHUNK, size + 1 - written)):
                written += len(chunk)
                if written > size:
                    raise ArchiveError(
                        f"{path}: member {name!r} holds more than its {size} bytes; refused"
                    )
                h.update(chunk)
                dst.write(chunk)
    except _READ_ERRORS as exc:
        raise ArchiveError(f"{path}: member {name!r} is corrupt: {exc}") from None
    if written != size or h.hexdigest() != m["sha256"]:
        raise ArchiveError(
            f"{path}: member {name!r} does not match its SHA-256 in {MANIFEST} (tampered or "
            "corrupt); refused"
        )


def _parsed_config(raw: bytes, config_name: str, path: Path) -> dict[str, Any]:
    try:
        config = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ArchiveError(f"{path}: its config {config_name!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ArchiveError(f"{path}: its config {config_name!r} is not a JSON object")
    return config


def _resolved_config(root: Path, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config with its models' paths inside ``root``, and ``root`` theirs."""
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
    try:
        target = (root / rel).resolve()
        inside = target.is_relative_to(root.resolve())
    except (OSError, ValueError):  # a NUL in the path, a symlink loop
        inside = False
    if not inside or PurePosixPath(rel).is_absolute():
        raise ArchiveError(f"{path}: its config's {where} {_cut(rel)} is outside the archive")
    return target


def expand_entry(
    entry: dict[str, Any], base_dir: Path, limits: Limits | None = None
) -> dict[str, Any]:
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
    config = serve_config(base_dir / entry["path"], limits)
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
