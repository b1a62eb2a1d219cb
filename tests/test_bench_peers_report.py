"""bench.peers.report: a run of a few servers added beside the committed full run.

Uses the committed ``bench/results-peers.json`` as the full run and a copy
of it, cut down to two servers and given another date, as the added run:
the full run's tables must stay as they were, and the added run must show
up once, in its own section, with its own facts.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import report

pytestmark = pytest.mark.timeout(30)

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results-peers.json"


def _small_run(base: dict[str, Any], date: str, servers: list[str]) -> dict[str, Any]:
    run = copy.deepcopy(base)
    run.pop("added", None)
    run["servers"] = servers
    run["facts"] = {**run["facts"], "date_utc": date, "command": "python -m bench.peers --add"}
    run["facts"].pop("reruns", None)
    for key in ("1", "2"):
        run["workloads"][key] = {s: run["workloads"][key][s] for s in servers}
    del run["workloads"]["3"]
    return run


def test_added_run_has_its_own_section_and_replaces_one_of_the_same_servers() -> None:
    base = json.loads(RESULTS.read_text())
    base.pop("added", None)
    before = report.render(base, "notes")
    first = _small_run(base, "2030-01-01 00:00 UTC", ["aserve", "plain"])
    second = _small_run(base, "2030-01-02 00:00 UTC", ["aserve", "plain"])
    other = _small_run(base, "2030-01-03 00:00 UTC", ["aserve", "litserve"])

    merged = report.add_run(report.add_run(report.add_run(base, first), other), second)

    assert [r["facts"]["date_utc"] for r in merged["added"]] == [
        "2030-01-03 00:00 UTC",
        "2030-01-02 00:00 UTC",
    ]
    assert merged["workloads"] == base["workloads"]  # the full run's rows are untouched
    text = report.render(merged, "notes")
    assert text.startswith(before[: before.index("## Notes")])
    assert text.count("## Added run: plain (2030-01-02 00:00 UTC)") == 1
    assert "2030-01-01" not in text
    # The kept run first, the replacing one last.
    assert text.index("## Added run: litserve") < text.index("## Added run: plain")
    section = text[text.index("## Added run: plain") : text.index("## Notes")]
    assert "`python -m bench.peers --add` on 2030-01-02 00:00 UTC" in section
    assert "\n### Workload 1: overhead" in section
    assert "\n### Workload 4: overload" in section
    assert "| litserve |" not in section


def test_add_run_does_not_nest_added_runs() -> None:
    base = json.loads(RESULTS.read_text())
    run = _small_run(base, "2030-01-01 00:00 UTC", ["aserve", "plain"])
    run["added"] = [copy.deepcopy(run)]
    merged = report.add_run(base, run)
    assert all("added" not in r for r in merged["added"])
