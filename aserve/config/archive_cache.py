"""Extracted archives in the cache: one folder per archive content, kept while some
process uses it, removed once none does.

``$ASERVE_CACHE_DIR/archives/<sha256>/`` holds the files of the archive whose
bytes hash to ``<sha256>``: a folder is named by content, so an archive
replaced in place gets a new folder, and one copied elsewhere reuses its own.

Who uses a folder, ``<sha256>.lock`` beside it says: a process holds a shared
``flock`` on it from before it checks or extracts the folder until it lets the
folder go (:func:`let_go`). Removing takes the lock exclusively, without
waiting, so it succeeds only where no process holds the lock: a folder some
server still serves from is never removed, whichever process sweeps, and a
process that wants a folder being removed waits for the removal to end, then
extracts it anew. The kernel drops a process's locks when it exits, crashed
or not, so nothing stays held by a server that is gone: the next sweep (every
server sweeps at startup) removes what it left.

Several processes may extract one archive at once: each extracts into a
folder of its own and renames it into place; a directory rename is atomic, so
the folder under the hash is whole or absent. A folder already there is
reused once its files match the manifest again.

Layer ``config``; blocking (hashing, extracting, removing): call off the loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from aserve.config.paths import cache_dir

_CHUNK = 1 << 20
_DIGEST = re.compile(r"^\.?(?:stale\.)?([0-9a-f]{64})(?:\.lock|\..*)?$")
_held: dict[Path, int] = {}  # lock file -> its descriptor, shared-locked by this process
_mutex = threading.Lock()  # _held, between the threads of one process
_NOT_OURS = (errno.EACCES, errno.EROFS, errno.EPERM)


class CacheError(Exception):
    """The cache cannot hold an archive (no room, cannot write)."""


def hasher() -> Any:
    return hashlib.sha256()


def sha256(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def archives_dir() -> Path:
    return (cache_dir() / "archives").absolute()


def folder(digest: str) -> Path:
    """Where the archive of content ``digest`` is extracted."""
    return archives_dir() / digest


def digest_of(root: str | Path | None) -> str | None:
    """The content digest whose folder ``root`` is, if it is one of this cache."""
    if root is None:
        return None
    root = Path(root)
    if root.parent != archives_dir() or not re.fullmatch(r"[0-9a-f]{64}", root.name):
        return None
    return root.name


def use(
    root: Path,
    total_bytes: int,
    is_whole: Callable[[Path], bool],
    extract_into: Callable[[Path], None],
) -> None:
    """Hold ``root`` for this process, then make it whole: reused when ``is_whole``
    says so, else extracted by ``extract_into(folder)`` beside it and renamed into
    place. ``total_bytes`` is what extracting writes (refused past the free space)."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            _hold(_lock_path(root))
        except OSError as exc:
            # A cache this process may not write (a read-only image, another user's):
            # a whole folder there is served as it is; none can be extracted.
            if exc.errno not in _NOT_OURS or not (root.is_dir() and is_whole(root)):
                raise
            return
        if root.is_dir() and is_whole(root):
            return
        free = shutil.disk_usage(root.parent).free
        if total_bytes > free:
            raise CacheError(
                f"extracting it takes {total_bytes} bytes; {root.parent} has {free} free"
            )
        _extract_into_place(root, is_whole, extract_into)
    except OSError as exc:
        raise CacheError(f"cannot extract into {root.parent}: {exc}") from None


def _extract_into_place(
    root: Path, is_whole: Callable[[Path], bool], extract_into: Callable[[Path], None]
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.{os.getpid()}.", dir=root.parent))
    try:
        extract_into(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700
        for _attempt in range(3):
            try:
                os.rename(tmp, root)  # atomic; fails while another folder is there
                return
            except OSError:
                pass
            if root.is_dir() and is_whole(root):
                return  # another process extracted it first
            # A stale or damaged folder: moved aside (atomically), then removed.
            aside = Path(tempfile.mkdtemp(prefix=f".stale.{root.name}.", dir=root.parent))
            with contextlib.suppress(OSError):
                os.rename(root, aside / "x")
            shutil.rmtree(aside, ignore_errors=True)
        raise CacheError(f"cannot put the extracted archive in place at {root}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lock_path(root: Path) -> Path:
    return root.with_name(f"{root.name}.lock")


def _hold(lock: Path) -> None:
    """A shared lock on ``lock`` for this process (once), waiting out a removal."""
    with _mutex:
        if lock in _held:
            return
    fd = _locked(lock, fcntl.LOCK_SH)  # may wait: not under the mutex
    assert fd is not None
    with _mutex:
        if lock in _held:  # another thread of this process took it meanwhile
            os.close(fd)
        else:
            _held[lock] = fd


def _locked(lock: Path, how: int) -> int | None:
    """A descriptor of ``lock`` locked ``how``; None where ``how`` has LOCK_NB and
    another process holds it. The file must still be the one at the path once
    locked: a remover unlinks it before letting go, and then it is opened again."""
    while True:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def keep_only(roots: Iterable[str | Path | None]) -> list[str]:
    """:func:`let_go` of all but ``roots``, then :func:`remove_unused`."""
    let_go(roots)
    return remove_unused()


def let_go(keep_roots: Iterable[str | Path | None]) -> None:
    """Let go of the folders this process holds but ``keep_roots``. Quick (closes
    descriptors); the caller makes sure no folder it lets go is about to be used."""
    keep = {d for d in map(digest_of, keep_roots) if d is not None}
    with _mutex:
        for lock in [lock for lock in _held if lock.name.removesuffix(".lock") not in keep]:
            os.close(_held.pop(lock))


def remove_unused() -> list[str]:
    """Remove every folder of the cache no process holds, and what extractions
    that died left beside them; returns the digests removed. Safe at any time:
    a folder is removed only under its lock taken exclusively."""
    with _mutex:
        held = {lock.name.removesuffix(".lock") for lock in _held}
    base = archives_dir()
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    found: dict[str, list[str]] = {}
    for name in names:
        match = _DIGEST.match(name)
        if match is not None:
            found.setdefault(match.group(1), []).append(name)
    removed = []
    for digest, entries in sorted(found.items()):
        if digest in held:
            continue
        if _remove_unused(base, digest, entries):
            removed.append(digest)
    return removed


def _remove_unused(base: Path, digest: str, entries: list[str]) -> bool:
    lock = base / f"{digest}.lock"
    try:
        fd = _locked(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _NOT_OURS:
            return False  # a cache this process may not change: left to its owner
        raise
    if fd is None:
        return False  # in use
    try:
        for name in entries:
            if not name.endswith(".lock"):
                shutil.rmtree(base / name, ignore_errors=True)
        # Unlinked before it is let go: whoever waits on this file opens it again.
        lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True
