"""The runtime directory where running servers register themselves (``aserve ps``).

Each server keeps one small JSON file, ``<pid>.json``, written atomically
(a temporary file renamed over it), so a reader sees a whole entry or the
previous one, never half of one. A server removes its entry when it stops;
one killed without a chance to (SIGKILL, a crash) leaves a stale entry,
which readers recognise and delete: its pid is not running, or is running
but started at another time than the entry says (the pid was reused).

Pure file and process look-ups: no asyncio, callable from any thread.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import orjson

ENV = "ASERVE_RUNTIME_DIR"


def runtime_dir() -> Path:
    """``$ASERVE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/aserve``, else ``~/.cache/aserve/run``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "aserve"
    return Path.home() / ".cache" / "aserve" / "run"


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque token (None: not running, or unknown).

    Linux: field 22 of ``/proc/PID/stat`` (clock ticks since boot); elsewhere
    psutil's create time when psutil is installed.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # a /proc system without this pid: not running
    except OSError:
        return None
    else:
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
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


def write_entry(folder: Path, pid: int, entry: dict[str, Any]) -> Path:
    """Write ``<pid>.json`` atomically (created private: it names the server's config)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{pid}.json"
    tmp = folder / f".{pid}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps(entry, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)
    return path


def remove_entry(folder: Path, pid: int) -> None:
    for name in (f"{pid}.json", f".{pid}.tmp"):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()


def live_entries(folder: Path) -> list[dict[str, Any]]:
    """The entries of running servers, by pid; stale ones (and unreadable ones of
    processes that are gone) are deleted."""
    try:
        paths = sorted(folder.iterdir())
    except FileNotFoundError:
        return []
    out = []
    for path in paths:
        stem = path.name.removeprefix(".").removesuffix(".json").removesuffix(".tmp")
        if not stem.isdigit():
            continue
        pid = int(stem)
        started = process_start_time(pid)
        if path.name.startswith("."):  # a temporary file left by a server that died writing
            if started is None:
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        try:
            raw = path.read_bytes()
            entry = orjson.loads(raw)
        except (OSError, orjson.JSONDecodeError):
            entry = None
        if not isinstance(entry, dict) or entry.get("pid") != pid:
            if started is None:
                _remove_if_unchanged(path, None)
            continue
        if started is None or (started != "unknown" and started != entry.get("proc_start")):
            _remove_if_unchanged(path, raw)
            continue
        out.append(entry)
    return sorted(out, key=lambda e: e["pid"])


def _remove_if_unchanged(path: Path, raw: bytes | None) -> None:
    # A new server that reused the pid may have just written its own entry there.
    with contextlib.suppress(OSError):
        if raw is None or path.read_bytes() == raw:
            path.unlink()
