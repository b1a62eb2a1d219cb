"""``aserve ps``: the aserve servers running on this machine (for this user).

Reads the entries servers keep in the runtime directory (see
:mod:`aserve.obs.registration`); stale ones, of servers killed without a
chance to remove theirs, are skipped and deleted. Files there that are not
entries (not a regular file, too large, a symlink, not an entry's JSON) are
skipped with one line each on stderr; a runtime directory that is not this
user's private one is refused (exit 1, naming the fix).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import orjson

from aserve.obs import runtime_dir


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ps",
        help="list the aserve servers running here",
        description="The aserve servers running on this machine, from $ASERVE_RUNTIME_DIR "
        "(default $XDG_RUNTIME_DIR/aserve, else ~/.cache/aserve/run).",
    )
    p.add_argument("--json", action="store_true", help="one JSON array, for programs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        listing = runtime_dir.live_entries(runtime_dir.runtime_dir())
    except OSError as exc:  # UnsafeRuntimeDir says the fix; others name the file
        print(f"aserve ps: error: {exc}", file=sys.stderr)
        return 1
    for line in listing.skipped:
        print(f"aserve ps: {line}", file=sys.stderr)
    entries = listing.entries
    now = time.time()
    for e in entries:
        e["uptime_s"] = round(max(0.0, now - float(e.get("started_at", now))), 1)
    if args.json:
        sys.stdout.write(orjson.dumps(entries, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(table(entries))
    return 0


def table(entries: list[dict[str, Any]]) -> str:
    """Aligned columns, one server a line (like ``grpst ps``)."""
    head = ("PID", "HTTP", "GRPC", "STATE", "UPTIME", "CONFIG", "MODELS")
    rows = [head]
    for e in entries:
        models = ", ".join(f"{m['name']}:{m['version']} {m['state']}" for m in e.get("models", []))
        rows.append(
            (
                str(e["pid"]),
                " ".join(e.get("http") or []) or "-",
                " ".join(e.get("grpc") or []) or "-",
                str(e.get("state", "?")),
                _duration(float(e.get("uptime_s", 0))),
                e.get("config") or e.get("command") or "-",
                models or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s // 60 % 60:02d}m"
    return f"{s // 86400}d{s // 3600 % 24:02d}h"
