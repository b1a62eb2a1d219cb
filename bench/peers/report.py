"""RESULTS-peers.md from a peers run's results (``python -m bench.peers.report`` re-renders).

The text between the notes markers of the previous file is kept (hand-written).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from bench import report as bench_report

TARGET_MINILM_VS_PEER = 1.3  # aserve / best peer req/s at c=64
TARGET_MINILM_VS_CEILING = 0.9
TARGET_ADMITTED_IN_TIME = 0.99

TITLES = {
    "1": "Workload 1: overhead (y = x + 1 on 16 floats)",
    "2": "Workload 2: batchable (all-MiniLM-L6-v2, one sentence per request)",
}


def _n(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _ok(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s: r for s, r in section.items() if "points" in r}


def _unary(key: str, section: dict[str, Any], ceiling: dict[str, Any] | None) -> list[str]:
    ok = _ok(section)
    lines = [f"## {TITLES[key]}", ""]
    if not ok:
        return [*lines, "No server produced numbers.", ""]
    cs = list(next(iter(ok.values()))["points"])
    lines += [
        "| server | c | req/s | p50 ms | p99 ms | errors | server CPU ms/req | other load "
        "| aserve / this (req/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    a = ok.get("aserve")
    for s, r in ok.items():
        for c in cs:
            p = r["points"][c]
            ratio = "-"
            if a is not None and s != "aserve" and p["rps"] > 0:
                ratio = f"{a['points'][c]['rps'] / p['rps']:.2f}"
            lines.append(
                f"| {s} | {c} | {_n(p['rps'])} | {_n(p['p50_ms'], 2)} | {_n(p['p99_ms'], 2)} "
                f"| {p['errors']} | {_n(p.get('server_cpu_ms_per_request'), 3)} "
                f"| {_n(p['other_cpu_util'], 2)} | {ratio} |"
            )
    lines += ["", "| server | cold start s | peak RSS of the tree MiB | answer checked |",
              "|---|---:|---:|---|"]  # fmt: skip
    for s, r in ok.items():
        lines.append(f"| {s} | {_n(r['cold_start_s'])} | {_n(r['peak_rss_mb'], 0)} "
                     f"| {'yes' if r.get('checked') else 'no'} |")  # fmt: skip
    lines.append("")
    lowest = []
    for c in cs:
        best = min(ok, key=lambda s: ok[s]["points"][c]["p99_ms"])
        lowest.append(f"c={c}: {best}")
    lines.append("Lowest p99: " + "; ".join(lowest) + ".")
    if a is not None and any("aserve_stats" in a["points"][c] for c in cs):
        lines += ["", "aserve in each window (its /stats): mean batch size, model busy share, "
                  "mean queue wait:"]  # fmt: skip
        for c in cs:
            st = a["points"][c].get("aserve_stats")
            if st:
                lines.append(f"- c={c}: batch {st['mean_batch_size']:.1f}, model busy "
                             f"{st['model_busy']:.0%}, queue {st['mean_queue_ms']:.1f} ms; "
                             "batches by size " + ", ".join(
                                 f"{k}: {v}" for k, v in st["batches_by_size"].items()))  # fmt: skip
        lines.append("")
    if key == "2" and a is not None:
        top = cs[-1]
        peers = {s: r["points"][top]["rps"] for s, r in ok.items() if s not in ("aserve",)}
        if peers:
            best = max(peers, key=lambda s: peers[s])
            ratio = a["points"][top]["rps"] / peers[best]
            lines.append(
                f"At c={top}: aserve / best peer ({best}) = **{ratio:.2f}** (target >= "
                f"{TARGET_MINILM_VS_PEER}: {'met' if ratio >= TARGET_MINILM_VS_PEER else 'missed'})."
            )
        if ceiling:
            frac = a["points"][top]["rps"] / ceiling["best_items_per_s"]
            lines.append(
                f"aserve / in-process ceiling ({_n(ceiling['best_items_per_s'])}/s at batch "
                f"{ceiling['best_batch_size']}) = **{frac:.2f}** (target >= "
                f"{TARGET_MINILM_VS_CEILING}: "
                f"{'met' if frac >= TARGET_MINILM_VS_CEILING else 'missed'})."
            )
    return [*lines, ""]


def _ceiling(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return []
    sizes = list(c["items_per_s"])
    return [
        "### MiniLM in-process ceiling",
        "",
        "The model called in a loop in its own process (one torch thread, tokenizing "
        "included, as the servers do), the same sentence at each batch size:",
        "",
        "| batch | " + " | ".join(sizes) + " |",
        "|---|" + "---:|" * len(sizes),
        "| sentences/s | " + " | ".join(_n(c["items_per_s"][s]) for s in sizes) + " |",
        "| ms per batch | " + " | ".join(_n(c["batch_ms"][s], 1) for s in sizes) + " |",
        "",
        f"Other load during it: {c['other_cpu_util']:.2f} cores.",
        "",
    ]


def _overload(results: dict[str, Any]) -> list[str]:
    section = results["workloads"].get("2", {})
    rows = {s: r["overload"] for s, r in section.items() if "overload" in r}
    if not rows:
        return []
    st = results["settings"]
    lines = [
        f"## Workload 4: overload (MiniLM, {results['overload_rate']:.0f} requests/s = "
        f"{st['overload_factor']}x the ceiling, {st['deadline_ms']:.0f} ms deadline)",
        "",
        "Open loop: requests leave at a fixed rate whatever the server does; the client gives "
        "a request up (and closes its connection) at the deadline. aserve also gets the "
        "deadline in its `aserve-timeout-ms` header, so it can refuse at once what it cannot "
        "finish in time. Due = requests whose send time fell in the window; not sent = due "
        "while the client already had 2048 connections open or opening (the server had "
        "stopped taking connections); sent = due - not sent. Refused = 429/503. Admitted = "
        "sent - refused. In time / sent counts not sent as missed. Health = GET of the "
        "server's health route every 50 ms during the window. Send lag: how far behind its "
        "schedule the load generator sent (large = the machine starved the client too).",
        "",
        "| server | due | not sent | in time | late | refused | failed | lost | goodput/s "
        "| in time / due | in time / admitted | p99 in-time ms | refusal p99 ms "
        "| health p99 ms | send lag p99 ms | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, o in rows.items():
        probe = o.get("probe") or {}
        lines.append(
            f"| {s} | {o['sent'] + o['not_sent']} | {o['not_sent']} | {o['ok_in_time']} "
            f"| {o['late']} "
            f"| {o['refused']} | {o['failed']} | {o['lost']} | {_n(o['goodput_rps'])} "
            f"| {_n(o['in_time_share'], 3)} | {_n(o['admitted_in_time_share'], 3)} "
            f"| {_n(o['p99_ms'])} | {_n(o['refusal_p99_ms'])} | {_n(probe.get('p99_ms'))} "
            f"| {_n(o['send_lag_p99_ms'])} | {_n(o.get('other_cpu_util'), 2)} |"
        )
    a = rows.get("aserve")
    if a is not None and a["admitted"] == 0:
        lines += ["", f"aserve admitted none of the {a['sent']} requests (all refused): the "
                  f"target of >= {TARGET_ADMITTED_IN_TIME} of admitted requests in time is "
                  "vacuous here, and its goodput is 0."]  # fmt: skip
    elif a is not None:
        share = a["admitted_in_time_share"]
        verdict = "met" if share >= TARGET_ADMITTED_IN_TIME else "missed"
        lines += ["", f"aserve: {_n(share, 3)} of admitted requests in time (target >= "
                  f"{TARGET_ADMITTED_IN_TIME}: {verdict})."]  # fmt: skip
    st_a = (a or {}).get("aserve_stats")
    if st_a:
        lines.append(
            f"aserve's own count in the window: {st_a['executions']} batches "
            f"({st_a['items']} items), model busy {st_a['model_busy']:.0%}, mean queue wait "
            f"{st_a['mean_queue_ms']:.0f} ms, refused as deadline-unmeetable (since start) "
            f"{st_a['rejected'].get('deadline_unmeetable', 0)}, queue full "
            f"{st_a['rejected'].get('queue_full', 0)}, timed out in queue {st_a['timed_out']}."
        )
    return [*lines, ""]


def _streaming(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    lines = [
        "## Workload 3: streaming (small decoder, OpenAI chat completions, SSE)",
        "",
        section.get("description", ""),
        "",
        "| server | streams | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| streams done | errors | server CPU (cores) | aserve / this (tokens/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    servers = section.get("servers", {})
    a = servers.get("aserve", {}).get("points")
    for s, r in servers.items():
        if "points" not in r:
            continue
        for c, p in r["points"].items():
            ratio = "-"
            if a and s != "aserve" and p["tokens_per_s"] > 0 and c in a:
                ratio = f"{a[c]['tokens_per_s'] / p['tokens_per_s']:.2f}"
            lines.append(
                f"| {s} | {c} | {_n(p['tokens_per_s'])} | {_n(p['ttft_p50_ms'])} "
                f"| {_n(p['ttft_p99_ms'])} | {_n(p['itl_p50_ms'], 2)} | {_n(p['itl_p99_ms'], 2)} "
                f"| {p['streams_completed']} | {p['errors']} | {_n(p['server_cpu_util'], 2)} "
                f"| {ratio} |"
            )
    lines += ["", "| server | cold start s | peak RSS MiB |", "|---|---:|---:|"]
    for s, r in servers.items():
        if "points" in r:
            lines.append(f"| {s} | {_n(r['cold_start_s'])} | {_n(r['peak_rss_mb'], 0)} |")
    return [*lines, ""]


def _failures(results: dict[str, Any]) -> list[str]:
    rows: list[tuple[str, str, str]] = []
    for s, f in results.get("failures", {}).items():
        rows.append((s, f["stage"], f["error"]))
    for key, section in results["workloads"].items():
        servers = section.get("servers", section) if key == "3" else section
        for s, r in servers.items():
            if isinstance(r, dict) and "error" in r:
                rows.append((s, f"workload {key}", r["error"]))
            if isinstance(r, dict) and "overload_error" in r:
                rows.append((s, "workload 4", r["overload_error"]))
    if not rows:
        return ["## Servers that could not run", "", "None: every server ran.", ""]
    lines = ["## Servers that could not run", ""]
    for s, stage, err in rows:
        lines += [f"### {s} ({stage})", "", "```", err.strip()[-1500:], "```", ""]
    return lines


def add_run(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``run`` kept beside it (``added``), not merged into its tables.

    A run of a few servers (new peers, with aserve again as the reference) on
    another day and load is not comparable row by row with the full run, so it
    is shown in its own section with its own facts. An earlier added run of the
    same servers is replaced; a full run (no ``--add``) drops them all.
    """
    run = {k: v for k, v in run.items() if k != "added"}
    kept = [r for r in base.get("added", []) if set(r["servers"]) != set(run["servers"])]
    return {**base, "added": [*kept, run]}


def _demoted(lines: list[str]) -> list[str]:
    return ["#" + x if x.startswith("#") else x for x in lines]


def _added(run: dict[str, Any]) -> list[str]:
    """One added run's section: its facts, then its tables one heading level down."""
    f, v = run["facts"], run["versions"]
    peers = [s for s in run["servers"] if not s.startswith("aserve")]
    lines = [
        f"## Added run: {', '.join(peers)} ({f['date_utc']})",
        "",
        f"Rows of a separate run: `{f['command']}` on {f['date_utc']} in {f['wall_s']:.0f} s, "
        f"aserve from commit {f.get('aserve_source', 'unknown')}; load average before "
        f"{f['loadavg_before']}, after {f['loadavg_after']}; busy cores just before the start: "
        f"{f['busy_cores_at_start']}. Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; torch {f['versions']['torch']}. Same settings and method as above; aserve ran "
        "again in it so that these peers are compared with aserve under the same load: "
        "compare these rows with each other, not with the tables above.",
        "",
    ]
    body: list[str] = []
    for key in ("1", "2"):
        if key in run["workloads"]:
            body += _unary(key, run["workloads"][key], run.get("ceiling") if key == "2" else None)
    body += _ceiling(run.get("ceiling")) if "2" in run["workloads"] else []
    body += _overload(run)
    body += _failures(run)
    return [*lines, *_demoted(body)]


def render(results: dict[str, Any], notes: str) -> str:
    f, st, v = results["facts"], results["settings"], results["versions"]
    lines = [
        "# aserve side by side with peer servers (issue 8)",
        "",
        f"Generated by `{f['command']}` on {f['date_utc']} in {f['wall_s']:.0f} s. "
        "Every number below comes from `results-peers.json` of that run.",
        "",
    ]
    for r in f.get("reruns", []):
        # A later run of some workloads replaced their sections (results-peers.json too).
        lines += [
            f"Workloads {r['workloads']} rerun by `{r['command']}` on {r['date_utc']} in "
            f"{r['wall_s']:.0f} s (aserve from commit {r['aserve_source']}; load average before "
            f"{r['loadavg_before']}, after {r['loadavg_after']}); their sections come from "
            "that run.",
            "",
        ]
    lines += [
        "## Machine, versions and method",
        "",
        f"- CPU: {f['cpu_model']}, {f['logical_cores']} logical cores ({f['usable_cores']} "
        f"usable), {f['memory_gib']} GiB; {f['os']}; Python {f['python']}.",
        f"- Load average before {f['loadavg_before']}, after {f['loadavg_after']}; busy "
        f"cores just before the start: {f['busy_cores_at_start']}. Each point's 'other load' "
        "is the cores kept busy by anything but the server and the load generator.",
        f"- aserve from commit {f.get('aserve_source', 'unknown')}.",
        "- Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; torch {f['versions']['torch']} (CPU build) in every environment.",
        f"- Every server: one model worker, torch threads {st['torch_threads']}, "
        "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1, per-request logging off, 127.0.0.1 only, one "
        f"server at a time. Batching: max batch {st['max_batch']}, max wait "
        f"{st['max_wait_ms']} ms (each peer's own knobs; '-nowait' rows: max wait 0); the "
        "plain aiohttp handler does not batch.",
        "- Same request bytes for every server (KServe V2 JSON, one item; the servers that "
        "do not speak V2, LitServe, Ray Serve, TorchServe, Mosec and the plain handler, read "
        "it as plain JSON at their own route and answer the same V2-shaped JSON), same load "
        "generator (`bench.loadgen`, its own process, closed loop: c keep-alive connections "
        f"with one request in flight each). Per point: {st['point_warmup']} s unrecorded, "
        f"then {st['duration']} s measured; before the points, a {st['warmup']} s warm-up at "
        "c=16. The first answer of every server was checked against the model run "
        "in-process. Cold start: process start to the first 200 answer. Peak RSS: the sum "
        "over the server's process tree, sampled every 0.5 s (shared pages count in each "
        "process). CPU per request: CPU seconds of the tree in the window / requests.",
        "",
    ]
    lines += _unary("1", results["workloads"]["1"], None) if "1" in results["workloads"] else []
    if "2" in results["workloads"]:
        lines += _unary("2", results["workloads"]["2"], results.get("ceiling"))
        lines += _ceiling(results.get("ceiling"))
    lines += _streaming(results["workloads"].get("3"))
    lines += _overload(results)
    lines += _failures(results)
    for run in results.get("added", []):
        lines += _added(run)
    lines += ["## Notes", "", notes, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    md = folder / "RESULTS-peers.md"
    results = json.loads((folder / "results-peers.json").read_text())
    md.write_text(render(results, bench_report.kept_notes(md.read_text() if md.is_file() else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
