"""Worst ``/v2/health/live`` latency per hostile-input case.

The hostile cases live in the test suite (every test that wraps its attack in
``tests/stall_watch.py``'s ``watch_loop``); this runs those tests with
``ASERVE_STALL_REPORT`` set, so that each watched case records its slowest
liveness probe and the longest the server saw its loop held by work, and writes
``bench/RESULTS-hostile.md``. The tests assert only that no window of the
server's own stall measure (``aserve_loop_stall_seconds``, CPU time) was held
past 1 s; the 100 ms probe latency a healthy server should keep is reported
here, case by case, beside the quiet p99.

    python -m bench.hostile            # from the repository root
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import kept_notes, machine_facts

ROOT = Path(__file__).resolve().parent.parent
TARGET_MS = 100.0
COMMAND = "python -m bench.hostile"


# The watchdog's own tests stall a loop on purpose: they test the watch, not a server.
_NOT_ATTACKS = ("test_stall_watch.py",)


def hostile_test_files() -> list[str]:
    """Every test file that watches the loop while it attacks the server."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if p.name not in _NOT_ATTACKS and "watch_loop" in p.read_text()
    )


def run(files: list[str]) -> tuple[list[dict[str, Any]], int]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as report:
        env = {**os.environ, "ASERVE_STALL_REPORT": report.name}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        lines = [json.loads(line) for line in report.read().splitlines() if line.strip()]
    worst: dict[str, dict[str, Any]] = {}
    for line in lines:  # a case may watch several times: keep its slowest
        if line["case"] not in worst or line["worst_ms"] > worst[line["case"]]["worst_ms"]:
            worst[line["case"]] = line
    return sorted(worst.values(), key=lambda d: -d["worst_ms"]), rc


def render(cases: list[dict[str, Any]], rc: int, facts: dict[str, Any], notes: str = "") -> str:
    """The results page; ``notes`` (a hand-written block, kept across runs) comes
    after the header: what each hostile-input issue's items do now."""
    over = [c for c in cases if c["worst_ms"] > TARGET_MS]
    out = [
        "# Hostile input: the loop's worst stall per case",
        "",
        f"Command: `{facts['command']}` ({facts['date_utc']}; {facts['cpu_model']}, "
        f"{facts['usable_cores']} usable cores; tests exit code {rc}).",
        "",
        "Each row is one test that attacks a real server on loopback while `/v2/health/live`",
        "is polled one request after another on a connection of its own. *Worst* is the",
        "slowest probe while the attack ran; *quiet p99* the same probe's p99 just before;",
        "*held* the longest the server's own measure saw its loop held by work",
        "(`aserve_loop_stall_seconds`: CPU time, up to a bucket's bound).",
        f"Target: worst <= {TARGET_MS:.0f} ms. The tests themselves assert only that no window",
        "was held past 1 s, which a busy machine cannot trip: waiting for a CPU is no work.",
        "",
        *([notes, ""] if notes else []),
        "## The loop's worst stall per case",
        "",
        f"{len(cases)} cases; {len(over)} over {TARGET_MS:.0f} ms. Load average while it ran: "
        f"{facts['load_average']} (other work on the machine inflates both columns).",
        "",
        "| case | worst | quiet p99 | held | probes |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in cases:
        flag = " **over**" if c["worst_ms"] > TARGET_MS else ""
        held = c.get("held_ms")  # absent from reports of before the stall measure
        out.append(
            f"| `{c['case']}` | {c['worst_ms']:.1f} ms{flag} | {c['quiet_p99_ms']:.2f} ms "
            f"| {'-' if held is None else f'<= {held:g} ms'} | {c['probes']} |"
        )
    return "\n".join(out) + "\n"


def _load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    facts = {**machine_facts(COMMAND), "load_average": _load_average()}
    cases, rc = run(hostile_test_files())
    md = ROOT / "bench" / "RESULTS-hostile.md"
    text = render(cases, rc, facts, kept_notes(md.read_text() if md.is_file() else ""))
    md.write_text(text)
    print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
