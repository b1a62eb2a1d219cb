"""The runtime directory where running servers register themselves (``aserve ps``).

Each server keeps one small JSON file, ``<pid>.json``, written atomically
(a temporary file renamed over it), so a reader sees a whole entry or the
previous one, never half of one. A server removes its entry when it stops;
one killed without a chance to (SIGKILL, a crash) leaves a stale entry,
which readers recognise and delete: its pid is not running, or is running
but started at another time than the entry says (the pid was reused).

The directory must be this user's own: a directory that another user owns,
or that others may write to (group or world writable, sticky bit or not),
could hold entries or links they planted, so it is refused
(:class:`UnsafeRuntimeDir`, naming the fix). Everything in it is reached
through one descriptor of the directory, opened without following a link
and checked once, so the directory cannot be swapped between the check and
the use. Files are created with ``O_EXCL | O_NOFOLLOW`` (a planted link is
never followed) and read without blocking (a FIFO) and with a size cap (a
device); an entry that is not a regular file, is too large, or is not a JSON
object of the expected shape is skipped and said so, never read without end.

Pure file and process look-ups: no asyncio, callable from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from aserve.config.paths import cache_dir

ENV = "ASERVE_RUNTIME_DIR"
# An entry is a few hundred bytes plus ~80 per model: 1 MiB is some 10,000 models.
MAX_ENTRY_BYTES = 1 << 20
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UnsafeRuntimeDir(PermissionError):
    """The runtime directory is not this user's private directory; the message says the fix."""


class _ModelState(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    name: str
    version: str
    state: str


class _Entry(BaseModel):
    """The shape an entry must have to be listed (fields a newer server adds pass through)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    pid: int
    proc_start: str | None
    started_at: float = 0.0
    version: str = ""
    command: str = ""
    config: str | None = None
    http: list[str] = []
    grpc: list[str] = []
    state: str = "?"
    models: list[_ModelState] = []


@dataclass
class Listing:
    """What :func:`live_entries` found: the running servers' entries, and one line for
    each file that looked like an entry but was skipped (and why)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def runtime_dir() -> Path:
    """``$ASERVE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/aserve``, else ``run`` in the
    cache directory (``$ASERVE_CACHE_DIR``, else ``~/.cache/aserve``): a user who
    moves the cache moves the registry with it."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "aserve"
    return cache_dir() / "run"


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque token (None: not running, or unknown).

    Linux: field 22 of ``/proc/PID/stat`` (clock ticks since boot); elsewhere
    psutil's create time when psutil is installed.
    """
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # a /proc system without this pid: not running
    except OSError:
        return None
    else:
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat_line[stat_line.rfind(b")") + 2 :].split()
        return fields[19].decode()  # field 22 of the whole line
    try:
        import psutil
    except ImportError:
        return "unknown" if _alive(pid) else None
    try:
        return repr(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _open_dir(folder: Path, create: bool) -> Iterator[int | None]:
    """A descriptor of ``folder`` once it is checked to be this user's private
    directory (None: it does not exist and ``create`` is false)."""
    if create:
        # Only the last component gets the mode; parents get the usual one.
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(folder, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and folder.is_symlink():
            raise UnsafeRuntimeDir(
                f"runtime directory {folder} is a symlink: set {ENV} to the directory itself"
            ) from None
        raise
    try:
        _check_private(folder, os.fstat(fd))
        yield fd
    finally:
        os.close(fd)


def _check_private(folder: Path, st: os.stat_result) -> None:
    fix = f"or set {ENV} to a directory of your own with mode 700"
    if st.st_uid != os.geteuid():
        raise UnsafeRuntimeDir(
            f"runtime directory {folder} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}): servers do not register there and ps does not read it; "
            f"remove it, {fix}"
        )
    if st.st_mode & _OTHERS_WRITE:
        raise UnsafeRuntimeDir(
            f"runtime directory {folder} may be written by other users "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): run chmod 700 {folder}, {fix}"
        )


def write_entry(folder: Path, pid: int, entry: dict[str, Any]) -> Path:
    """Write ``<pid>.json`` atomically (created private: it names the server's config)."""
    data = orjson.dumps(entry, option=orjson.OPT_INDENT_2)
    tmp = f".{pid}.tmp"
    with _open_dir(folder, create=True) as dfd:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            # Ours, left by a write this pid's earlier process cut short, or anything
            # else: removed (a link itself, never its target), then made anew.
            os.unlink(tmp, dir_fd=dfd)
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # rename replaces what is at the name (a link too), never what it leads to.
            os.replace(tmp, f"{pid}.json", src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    return folder / f"{pid}.json"


def remove_entry(folder: Path, pid: int) -> None:
    with _open_dir(folder, create=False) as dfd:
        if dfd is None:
            return
        for name in (f"{pid}.json", f".{pid}.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)


def live_entries(folder: Path) -> Listing:
    """The entries of running servers, by pid; stale ones (and unreadable ones of
    processes that are gone) are deleted, and files that are not entries are skipped
    with a line in :attr:`Listing.skipped`. :class:`UnsafeRuntimeDir` when ``folder``
    is not this user's private directory."""
    out = Listing()
    with _open_dir(folder, create=False) as dfd:
        if dfd is None:
            return out
        for name in sorted(os.listdir(dfd)):
            stem = name.removeprefix(".").removesuffix(".json").removesuffix(".tmp")
            if not stem.isdigit() or name not in (f"{stem}.json", f".{stem}.tmp"):
                continue
            pid = int(stem)
            started = process_start_time(pid)
            if name.startswith("."):  # a temporary file left by a server that died writing
                if started is None:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dfd)
                continue
            raw, why = _read_bounded(dfd, name)
            if raw is None:  # not a regular file: not ours to delete
                out.skipped.append(f"skipped {folder / name}: {why}")
                continue
            entry, why = _parse(raw, pid)
            if entry is None:
                if started is None:  # a write cut short, or junk, of a process that is gone
                    _remove_if_unchanged(dfd, name, None)
                else:
                    out.skipped.append(f"skipped {folder / name}: {why}")
                continue
            if started is None or (started != "unknown" and started != entry["proc_start"]):
                _remove_if_unchanged(dfd, name, raw)
                continue
            out.entries.append(entry)
    out.entries.sort(key=lambda e: e["pid"])
    return out


def _read_bounded(dfd: int, name: str) -> tuple[bytes | None, str]:
    """The bytes of regular file ``name`` (at most MAX_ENTRY_BYTES), or None and why not.

    Opened without following a link and without blocking (a FIFO would wait for
    a writer), then checked to be a regular file before a byte is read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | _NOFOLLOW, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symlink, not an entry"
        return None, f"cannot open it: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"not a regular file ({_kind(st.st_mode)})"
        if st.st_size > MAX_ENTRY_BYTES:
            return None, f"{st.st_size} bytes, over the {MAX_ENTRY_BYTES} an entry may have"
        chunks, left = [], MAX_ENTRY_BYTES + 1  # one more: a file that grew is seen to
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            return None, f"over the {MAX_ENTRY_BYTES} bytes an entry may have"
        return b"".join(chunks), ""
    except OSError as exc:
        return None, f"cannot read it: {exc.strerror}"
    finally:
        os.close(fd)


def _parse(raw: bytes, pid: int) -> tuple[dict[str, Any] | None, str]:
    """The entry ``raw`` holds, if it is one of ``pid``'s, else None and why not."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(doc, dict):
        return None, f"not an entry: a JSON {type(doc).__name__}, not an object"
    try:
        entry = _Entry.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return None, f"not an entry: {where}: {first['msg']}"
    if entry.pid != pid:
        return None, f"not an entry: its pid {entry.pid} is not its name's"
    return entry.model_dump(exclude_unset=True), ""


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"mode {mode:o}"


def _remove_if_unchanged(dfd: int, name: str, raw: bytes | None) -> None:
    # A new server that reused the pid may have just written its own entry there.
    if raw is not None and _read_bounded(dfd, name)[0] != raw:
        return
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)
