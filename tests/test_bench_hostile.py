"""bench.hostile's page: the stall table from a run, and the hand-written notes kept
from the page before it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import hostile
from bench.report import NOTES_BEGIN, NOTES_END, kept_notes

pytestmark = pytest.mark.timeout(30)

FACTS = {"command": hostile.COMMAND, "date_utc": "2026-12-02 07:47 UTC", "cpu_model": "a CPU",
         "usable_cores": 2, "load_average": "0.5, 0.5, 0.5"}  # fmt: skip


def _case(name: str, worst_ms: float) -> dict[str, object]:
    return {"case": name, "worst_ms": worst_ms, "quiet_p99_ms": 1.0, "probes": 10}


def test_a_rerun_keeps_the_notes_and_replaces_the_table() -> None:
    notes = f"{NOTES_BEGIN}\n## Items\n| 1 | a finding | what it does now |\n{NOTES_END}"
    first = hostile.render([_case("tests/a.py::t", 250.0)], 0, FACTS, notes)
    assert notes in first and "`tests/a.py::t` | 250.0 ms **over**" in first
    again = hostile.render([_case("tests/b.py::t", 5.0)], 0, FACTS, kept_notes(first))
    assert notes in again
    assert "tests/a.py::t" not in again and "1 cases; 0 over 100 ms" in again
    assert again.index(NOTES_END) < again.index("## The loop's worst stall per case")


def test_the_committed_page_carries_its_notes() -> None:
    page = (Path(hostile.ROOT) / "bench" / "RESULTS-hostile.md").read_text()
    assert NOTES_BEGIN in page and NOTES_END in page
