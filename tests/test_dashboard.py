"""The dashboard: ``GET /`` in real headless Chromium under live traffic, and its stats endpoint.

The browser is the system's Chromium (Debian's ``chromium``), driven by
playwright; playwright's own browser download is never used. Without
Chromium the browser tests are skipped, saying why, except under CI
(``CI=true``), where ``.ci/run`` installs it and its absence is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from gen_helpers import GENERATION
from helpers import sync_wait_for_stats
from lm_models import tiny_model
from reload_helpers import copy_handler

from aserve.config import AuthConfig, DashboardConfig
from aserve.frontends.http.dashboard_history import DashboardHistory

pytestmark = pytest.mark.timeout(120)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_COPY = Path(__file__).parent.parent / "test-output" / "dashboard.png"
KEYS_ENV = "ASERVE_TEST_DASHBOARD_KEYS"
AFFINE = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
AFFINE_BAD = {
    "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1.0] * 3}]
}
GENERATE = {"text_input": "Hello", "max_tokens": 8, "temperature": 0}


def chromium() -> Any:
    """playwright's ``sync_playwright``; skips (fails under CI) without it or without Chromium."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install -e '.[dev]')"
    if not os.path.exists(CHROMIUM):
        missing = f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    if missing is None:
        return sync_playwright
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{missing}; CI must have it: .ci/run installs it")
    pytest.skip(missing)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def post(url: str, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=orjson.dumps(doc), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


def stats(base: str) -> dict[str, Any]:
    status, content_type, body = get(base + "/v2/dashboard/stats")
    assert status == 200 and content_type.startswith("application/json")
    return orjson.loads(body)


def model(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in doc["models"] if m["name"] == name)


@pytest.fixture(scope="module")
def dash_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """affine (batched) and a tiny gpt2 decoder, so that every chart has something to show."""
    folder = tmp_path_factory.mktemp("dashboard")
    gpt2 = tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    models = [
        model_entry(
            "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
            [spec("OUTPUT0", "FP32", [16])],
            batching={"max_batch_size": 8, "max_delay_ms": 2.0},
        ),
        {"name": "gpt2", "engine": "decoder", "path": str(gpt2), "generation": GENERATION},
    ]  # fmt: skip
    srv = start_server(write_config(folder, {"models": models}))
    yield srv
    srv.stop()


def test_stats_match_the_traffic(dash_server: ServerProcess) -> None:
    base = dash_server.base
    before = stats(base)
    assert [post(base + "/v2/models/affine/infer", AFFINE)[0] for _ in range(6)] == [200] * 6
    assert [post(base + "/v2/models/affine/infer", AFFINE_BAD)[0] for _ in range(2)] == [400] * 2
    status, answer = post(base + "/v2/models/gpt2/generate", GENERATE)
    assert status == 200
    sync_wait_for_stats(base, "affine", lambda s: s["running_batch_count"] == 0)
    sync_wait_for_stats(base, "gpt2", lambda s: s["generation"]["running_sequence_count"] == 0)
    after = stats(base)

    a0, a1 = model(before, "affine"), model(after, "affine")
    assert (a1["version"], a1["ready"]) == ("1", True)
    assert a1["requests"] - a0["requests"] == 8
    assert a1["errors"] - a0["errors"] == 2
    bounds = after["latency_bounds_s"]
    assert len(a1["latency_counts"]) == len(bounds) + 1  # the last counts those over every bound
    assert sum(a1["latency_counts"]) - sum(a0["latency_counts"] or [0]) == 6  # successes only
    assert a1["batch_items"] - a0["batch_items"] == 6
    assert 1 <= a1["executions"] - a0["executions"] <= 6
    assert (a1["queued"], a1["running"]) == (0, 0)
    assert a1["generated_tokens"] is None and a1["running_sequences"] is None

    g0, g1 = model(before, "gpt2"), model(after, "gpt2")
    assert g1["requests"] - g0["requests"] == 1 and g1["errors"] == g0["errors"]
    tokens = answer["usage"]["completion_tokens"]
    assert tokens > 0 and g1["generated_tokens"] - g0["generated_tokens"] == tokens
    assert g1["running_sequences"] == 0

    assert after["t"] > before["t"] and after["time"] >= before["time"]
    proc = after["process"]
    assert proc["cpu_seconds"] >= before["process"]["cpu_seconds"] > 0
    assert proc["rss_bytes"] > 16 * 2**20 and proc["rss_is_peak"] is False  # /proc here
    assert proc["cpu_count"] >= 1
    # gpt2 steps in a child process, whose CPU and memory are counted in.
    assert proc["child_processes"] == 1
    (child,) = [
        p
        for p in psutil.Process(dash_server.proc.pid).children()
        if "spawn_main" in " ".join(p.cmdline())
    ]
    assert proc["rss_bytes"] > child.memory_info().rss
    assert isinstance(after["gpus"], list)  # entries only where NVML sees a GPU


def test_page_is_self_contained(dash_server: ServerProcess) -> None:
    status, content_type, body = get(dash_server.base + "/")
    assert status == 200 and content_type.startswith("text/html")
    page = body.decode()
    assert "v2/dashboard/stats" in page and len(body) < 24 * 1024
    # Nothing to fetch from elsewhere (the SVG namespace is a name, not a fetch).
    rest = page.replace('"http://www.w3.org/2000/svg"', "")
    assert re.search(r"https?://|//[a-z]|\b(src|href)\s*=|@import|url\(", rest, re.I) is None


def test_dashboard_and_stats_are_open_by_default() -> None:
    defaults = AuthConfig(api_keys_env="X").open_paths
    assert "/" in defaults and "/v2/dashboard/stats" in defaults and "/metrics" in defaults


@pytest.fixture
def traffic(dash_server: ServerProcess) -> Iterator[list[str]]:
    """Steady inference traffic (affine from 3 threads, gpt2 from 1) until the test ends;
    yields the failed answers."""
    stop = threading.Event()
    failures: list[str] = []
    base = dash_server.base

    def send(path: str, doc: dict[str, Any]) -> None:
        deadline = time.monotonic() + 60  # bounded in time and count, whatever the test does
        for _ in range(20_000):
            if stop.is_set() or time.monotonic() > deadline:
                return
            status, answer = post(base + path, doc)
            if status != 200:
                failures.append(f"{path}: {status} {answer}")
            time.sleep(0.005)

    threads = [
        threading.Thread(target=send, args=("/v2/models/affine/infer", AFFINE), daemon=True)
        for _ in range(3)
    ]
    threads.append(
        threading.Thread(target=send, args=("/v2/models/gpt2/generate", GENERATE), daemon=True)
    )
    for t in threads:
        t.start()
    yield failures
    stop.set()
    for t in threads:
        t.join(10)


# Charts whose latest point must be > 0 while traffic flows; the queue's may be 0.
BUSY = ["process cpu", "process rss", "affine/1 rps", "affine/1 latency", "affine/1 batch",
        "gpt2/1 rps", "gpt2/1 latency", "gpt2/1 batch", "gpt2/1 tokens"]  # fmt: skip
_CHARTS_JS = """() => [...document.querySelectorAll('svg[data-chart]')].map(e => ({
    id: e.dataset.chart, samples: +(e.dataset.samples || 0), last: e.dataset.last || '',
    lines: [...e.querySelectorAll('path.line')].map(p => p.getAttribute('d') || '')}))"""
_BUSY_JS = """(busy) => busy.every(id => {
    const e = document.querySelector(`svg[data-chart="${id}"]`);
    return e && +e.dataset.samples >= 4 && +e.dataset.last > 0;
})"""


def test_dashboard_shows_live_traffic(
    dash_server: ServerProcess, traffic: list[str], tmp_path: Path
) -> None:
    sync_playwright = chromium()
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "console",
                lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None,
            )
            page.goto(dash_server.base + "/")
            page.wait_for_function(_BUSY_JS, arg=BUSY, timeout=45_000, polling=200)
            charts = {c["id"]: c for c in page.evaluate(_CHARTS_JS)}
            status_line = page.inner_text("#status")
            no_devices = page.is_hidden("#devices")  # neither a shared device nor a budget
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    SCREENSHOT_COPY.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT_COPY)

    assert problems == [] and traffic == []
    assert status_line.startswith("updated") and no_devices
    for id in BUSY:
        c = charts[id]
        assert c["samples"] >= 4 and float(c["last"]) > 0, c
        assert re.search(r"^M[\d.]+,[\d.]+L", c["lines"][0]), c  # a drawn line of points
    assert float(charts["affine/1 batch"]["last"]) >= 1
    for name in ("affine/1", "gpt2/1"):
        assert charts[f"{name} queue"]["samples"] >= 2
    assert "affine/1 tokens" not in charts  # tokens/s only for decoder models
    for name in ("affine/1", "gpt2/1"):  # the latency CDF of the traffic so far
        assert charts[f"{name} cdf"]["samples"] >= 2, charts[f"{name} cdf"]
    assert shot.stat().st_size > 10_000


# A stand-in for pynvml (nvidia-ml-py), imported by the server from PYTHONPATH:
# one GPU, 40% busy, 3 of 8 GiB used, so that the GPU charts are drawn without one.
FAKE_PYNVML = """
from types import SimpleNamespace
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetUUID(handle): return "GPU-stand-in"
def nvmlDeviceGetUtilizationRates(handle): return SimpleNamespace(gpu=40)
def nvmlDeviceGetMemoryInfo(handle): return SimpleNamespace(used=3 << 30, total=8 << 30)
"""


@pytest.fixture(scope="module")
def keyed_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """API keys, with only the page open (the stats need a key), and a stand-in GPU."""
    folder = tmp_path_factory.mktemp("dashboard-keyed")
    (folder / "pynvml.py").write_text(FAKE_PYNVML)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    models = [
        model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                    [spec("OUTPUT0", "FP32", [16])]),
    ]  # fmt: skip
    config = {
        "auth": {"api_keys_env": KEYS_ENV, "open_paths": ["/v2/health/ready", "/"]},
        "models": models,
    }
    srv = start_server(
        write_config(folder, config), extra_env={KEYS_ENV: "dash-key", "PYTHONPATH": path}
    )
    yield srv
    srv.stop()


def test_closed_stats_need_a_key_the_page_asks_for(
    keyed_server: ServerProcess, tmp_path: Path
) -> None:
    base = keyed_server.base
    assert get(base + "/")[0] == 200
    assert get(base + "/v2/dashboard/stats")[0] == 401
    status, _, body = get(base + "/v2/dashboard/stats", {"Authorization": "Bearer dash-key"})
    doc = orjson.loads(body)
    assert status == 200 and model(doc, "affine")["ready"]
    assert doc["gpus"] == [
        {
            "index": "0",
            "uuid": "GPU-stand-in",
            "utilization": 0.4,
            "memory_used_bytes": 3 << 30,
            "memory_total_bytes": 8 << 30,
        }
    ]

    sync_playwright = chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(base + "/")
            page.wait_for_selector("#auth:not([hidden])", timeout=15_000)
            assert page.inner_text("#status") == "API key needed"
            page.fill("#key", "dash-key")
            page.click("#auth button")
            busy = ["process rss", "gpu0 util", "gpu0 memory"]
            page.wait_for_function(_BUSY_JS, arg=busy, timeout=15_000, polling=200)
            assert page.is_hidden("#auth")
            assert page.locator('svg[data-chart="affine/1 rps"]').count() == 1
            charts = {c["id"]: c for c in page.evaluate(_CHARTS_JS)}
            assert float(charts["gpu0 util"]["last"]) == 40
            assert float(charts["gpu0 memory"]["last"]) == 3  # GiB
            assert "of 8" in page.inner_text("#proc")
            page.screenshot(path=str(tmp_path / "dashboard-gpu.png"), full_page=True)
        finally:
            browser.close()


# --- the history ring, the latency CDF and handlers' metrics -----------------------------

HISTORY_S = 20  # a short window, so that the test sees all of it without waiting minutes


def metered(name: str, executor: str) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "metered:Metered", "executor": executor,
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def metered_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The metered handler on threads and in a worker process; a 20 s history, sampled at 2 Hz."""
    folder = tmp_path_factory.mktemp("dashboard-metered")
    copy_handler(folder, "metered")
    config = {
        "dashboard": {"history_s": HISTORY_S, "sample_interval_s": 0.5},
        "models": [metered("metered", "thread"), metered("metered_proc", "process")],
    }
    srv = start_server(write_config(folder, config))
    yield srv
    srv.stop()


METERED = {
    "inputs": [{"name": "X", "shape": [2, 2], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}],
    "parameters": {"tag": "page"},
}


def wait_history(base: str, span_s: float, timeout: float = 60) -> dict[str, Any]:
    """The stats with the ring, once the ring reaches ``span_s`` seconds back."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = get(base + "/v2/dashboard/stats?history=1")
        assert status == 200
        doc = orjson.loads(body)
        ring = doc["history"]
        # Spanning far enough, and the models already in it (the ring starts before they load).
        if ring and ring[-1]["t"] - ring[0]["t"] >= span_s and ring[-1]["models"]:
            return doc
        assert time.monotonic() < deadline, f"the ring spans {len(ring)} samples only"
        time.sleep(0.2)


def test_history_ring_keeps_the_last_window_only() -> None:
    n = iter(range(1000))
    ring = DashboardHistory(lambda: {"n": next(n)}, span_s=10, interval_s=0.5)
    for _ in range(100):
        ring.take()
    kept = orjson.loads(ring.json())
    assert [d["n"] for d in kept] == list(range(79, 100))  # 10 s / 0.5 s, and the newest
    assert ring.json() is ring.json()  # joined once per snapshot
    with pytest.raises(ValueError, match="7200 snapshots, over the limit 3600"):
        DashboardConfig(history_s=3600, sample_interval_s=0.5)


def test_history_ring_is_bounded_and_in_the_stats(metered_server: ServerProcess) -> None:
    base = metered_server.base
    doc = wait_history(base, HISTORY_S)
    assert (doc["history_s"], doc["sample_interval_s"]) == (HISTORY_S, 0.5)
    ring = doc["history"]
    assert len(ring) <= HISTORY_S / 0.5 + 1  # the ring's bound: older snapshots are gone
    assert all(a["t"] < b["t"] for a, b in pairwise(ring))
    assert ring[-1]["t"] <= doc["t"]
    assert {m["name"] for m in ring[-1]["models"]} == {"metered", "metered_proc"}
    assert "history" not in stats(base)  # only when asked for


def test_page_shows_history_cdf_and_handler_metrics(
    metered_server: ServerProcess, tmp_path: Path
) -> None:
    sync_playwright = chromium()
    base = metered_server.base
    # The CDF counts the requests after the window's first snapshot of the model.
    wait_history(base, 1.0)
    for model in ("metered", "metered_proc"):
        assert [post(f"{base}/v2/models/{model}/infer", METERED)[0] for _ in range(5)] == [200] * 5
    # Opened late: the server's ring already reaches further back than the page lives.
    opened_at = wait_history(base, HISTORY_S * 0.75)["t"]
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.goto(base + "/")
            counter = 'svg[data-chart="metered_proc/1 custom aserve_handler_items"]'
            page.wait_for_selector(counter, timeout=15_000)
            charts = page.evaluate(_HISTORY_JS)
            ticks = page.evaluate(_TICKS_JS, "process rss")
            cdf_ticks = page.evaluate(_TICKS_JS, "metered/1 cdf")
            custom_text = page.inner_text("#m-metered_proc\\/1 .custom")
            shot = tmp_path / "dashboard-metrics.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    SCREENSHOT_COPY.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT_COPY.with_name("dashboard-metrics.png"))
    assert problems == []

    # The time axis spans the configured window, with points from before the page opened.
    rss = charts["process rss"]
    assert float(rss["span"]) == HISTORY_S and ticks == [
        "\u221220 s",
        "\u221210 s",
        "now",
    ]  # minus signs
    assert float(rss["oldest"]) < opened_at - HISTORY_S * 0.5
    assert int(rss["samples"]) >= HISTORY_S * 0.75 / 0.5

    # The CDF: every request of the window, climbing to 100%, on a latency axis.
    for model in ("metered", "metered_proc"):
        cdf = charts[f"{model}/1 cdf"]
        assert int(cdf["count"]) >= 5 and float(cdf["last"]) == 1.0, cdf
        assert re.search(r"^M[\d.]+,[\d.]+L", cdf["line"]), cdf
    assert all(t.endswith((" ms", " s")) for t in cdf_ticks), cdf_ticks

    # Handlers' counters: 2 items per request, from threads and from the worker process.
    for model in ("metered", "metered_proc"):
        items = charts[f"{model}/1 custom aserve_handler_items"]
        assert float(items["total"]) >= 10, items
        requests = charts[f"{model}/1 custom aserve_handler_requests"]
        assert float(requests["total"]) >= 5, requests
    assert "aserve_handler_items" in custom_text and "total" in custom_text
    # Gauges as their values (the process that ran the last infer), histograms as the
    # p50/p99 of the observations in the window (every row sums to 3 or 7 here).
    pids = {
        "metered": metered_server.proc.pid,
        "metered_proc": metered_server.worker_pid("metered_proc"),
    }
    for model, pid in pids.items():
        gauge = charts[f"{model}/1 custom aserve_handler_infer_pid"]
        assert float(gauge["last"]) == pid and int(gauge["samples"]) >= 1, gauge
        assert gauge["line"].startswith("M"), gauge
        sums = charts[f"{model}/1 custom aserve_handler_row_sums"]
        assert int(sums["total"]) >= 10 and int(sums["samples"]) >= 1, sums
        assert sums["line"].startswith("M"), sums
    assert "aserve_handler_row_sums" in custom_text and "p99" in custom_text
    status, _, body = get(base + "/metrics")
    assert status == 200 and b'aserve_handler_items_total{model="metered_proc"' in body


_HISTORY_JS = """() => Object.fromEntries([...document.querySelectorAll('svg[data-chart]')].map(
    e => [e.dataset.chart, {...e.dataset, line: (e.querySelector('path.line') || {}).getAttribute?.('d') || ''}]))"""
_TICKS_JS = """(id) => [...document.querySelector(`svg[data-chart="${id}"]`).closest('.card')
    .querySelectorAll('.axis span')].map(e => e.textContent)"""


# --- shared devices and memory budgets ---------------------------------------------------

BUDGET_MIB = 2048
SLEEPER = {
    "inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}],
}


def sleeper(name: str) -> dict[str, Any]:
    """A python handler taking about 10 ms a batch, so that its bars are wide enough to see."""
    return {
        "name": name, "engine": "python", "handler": "sleeper:Sleeper",
        "parameters": {"sleep_ms": 10},
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two models on one shared slot of the CPU, under a memory budget; the ring sampled at 2 Hz."""
    folder = tmp_path_factory.mktemp("dashboard-shared")
    copy_handler(folder, "sleeper")
    config = {
        "dashboard": {"history_s": HISTORY_S, "sample_interval_s": 0.5},
        "devices": {"cpu": {"scheduling": "shared", "slots": 1, "memory_budget_mib": BUDGET_MIB}},
        "models": [sleeper("alpha"), sleeper("beta")],
    }
    srv = start_server(write_config(folder, config))
    yield srv
    srv.stop()


@pytest.fixture
def shared_traffic(shared_server: ServerProcess) -> Iterator[list[str]]:
    """Both models asked without pause (two threads each) until the test ends; yields failures."""
    stop = threading.Event()
    failures: list[str] = []

    def send(name: str) -> None:
        deadline = time.monotonic() + 90  # bounded, whatever the test does
        while not stop.is_set() and time.monotonic() < deadline:
            status, answer = post(f"{shared_server.base}/v2/models/{name}/infer", SLEEPER)
            if status != 200:
                failures.append(f"{name}: {status} {answer}")

    threads = [threading.Thread(target=send, args=(n,), daemon=True) for n in ("alpha", "beta") * 2]
    for t in threads:
        t.start()
    yield failures
    stop.set()
    for t in threads:
        t.join(10)


def wait_timeline(base: str, labels: set[str], timeout: float = 60) -> dict[str, Any]:
    """The stats once the shared device's timeline holds batches of every model of ``labels``."""
    deadline = time.monotonic() + timeout
    while True:
        doc = stats(base)
        if doc["devices"] and labels <= {row[0] for row in doc["devices"][0]["timeline"]}:
            return doc
        assert time.monotonic() < deadline, f"the timeline never held {labels}: {doc['devices']}"
        time.sleep(0.1)


def test_stats_show_the_shared_device_and_its_memory(
    shared_server: ServerProcess, shared_traffic: list[str]
) -> None:
    doc = wait_timeline(shared_server.base, {"alpha/1", "beta/1"})
    (device,) = doc["devices"]
    assert (device["name"], device["scheduling"], device["slots"]) == ("cpu", "shared", 1)
    assert device["members"] == ["alpha/1", "beta/1"]
    assert 0 <= device["busy"] <= 1 and 0 <= device["waiting"] <= 2
    for model, started, ended, size in device["timeline"]:
        assert model in ("alpha/1", "beta/1") and started <= ended <= doc["t"] and 1 <= size <= 4
    # One slot: the device never ran two batches at once.
    runs = sorted(device["timeline"], key=lambda r: r[1])
    assert all(a[2] <= b[1] for a, b in pairwise(runs)), runs

    memory = doc["memory"]
    (cpu,) = [d for d in memory["devices"] if d["name"] == "cpu"]
    models = {m["name"]: m for m in memory["models"]}
    assert set(models) == {"alpha", "beta"}
    for m in models.values():
        assert (m["version"], m["device"], m["state"]) == ("1", "cpu", "READY")
        assert (m["loads"]["ok"], m["loads"]["failed"], m["evictions"]) == (1, 0, 0)
        assert m["footprint_mib"] >= 0
        assert "load_seconds" not in m  # an object of /metrics', not JSON
    # What the device holds is its loaded models' footprints, within the budget.
    assert cpu["budget_mib"] == BUDGET_MIB
    held = sum(m["footprint_mib"] for m in models.values())
    assert cpu["used_mib"] == pytest.approx(held) and cpu["used_mib"] <= BUDGET_MIB

    # The history ring's snapshots carry the devices without their timelines.
    ring = wait_history(shared_server.base, 1.0)["history"]
    with_devices = [h for h in ring if h["devices"]]
    assert with_devices and all("timeline" not in d for h in with_devices for d in h["devices"])
    assert shared_traffic == []


_STRIP_JS = """(labels) => {
    const card = document.querySelector('#devices .dev[data-device="cpu"]');
    const strip = card && card.querySelector('svg.strip[data-drawn]');
    const mem = card && card.querySelector('.mem[data-budget]');
    return !!strip && !!mem && labels.every(l => {
        const e = card.querySelector(`.legend [data-model="${l}"]`);
        return e && +e.dataset.bars >= 1;
    });
}"""
_DEVICE_JS = """() => {
    const card = document.querySelector('#devices .dev[data-device="cpu"]');
    const strip = card.querySelector('svg.strip');
    return {
        hidden: card.closest('#devices').hidden,
        bars: +strip.dataset.bars,
        rows: strip.getAttribute('viewBox'),
        rects: [...strip.querySelectorAll('rect')].map(r => ({
            model: r.querySelector('title').textContent.split(':')[0], fill: r.getAttribute('fill'),
            x: +r.getAttribute('x'), width: +r.getAttribute('width')})),
        legend: [...card.querySelectorAll('.legend [data-model]')].map(e => ({
            model: e.dataset.model, bars: +e.dataset.bars,
            color: getComputedStyle(e.querySelector('i')).backgroundColor})),
        slots: card.querySelector('.top .val').textContent,
        memory: {...card.querySelector('.mem').dataset,
                 text: card.querySelector('.mem').innerText,
                 width: card.querySelector('.mem .bar div').style.width},
    };
}"""


def rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def test_page_draws_the_shared_device_strip_and_memory(
    shared_server: ServerProcess, shared_traffic: list[str], tmp_path: Path
) -> None:
    sync_playwright = chromium()
    base = shared_server.base
    labels = ["alpha/1", "beta/1"]
    wait_timeline(base, set(labels))  # both models have run on the device before the page opens
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "console",
                lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None,
            )
            page.goto(base + "/")
            page.wait_for_function(_STRIP_JS, arg=labels, timeout=45_000, polling=200)
            shown = page.evaluate(_DEVICE_JS)
            shot = tmp_path / "dashboard-devices.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    SCREENSHOT_COPY.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT_COPY.with_name("dashboard-devices.png"))
    assert problems == [] and shared_traffic == []

    assert shown["hidden"] is False
    assert shown["rows"] == "0 0 300 18"  # one slot: one row
    assert re.fullmatch(r"[01] of 1 slot\(s\) busy · [012] model\(s\) waiting", shown["slots"])
    # The legend names both models, each with its own colour, and its bars wear it.
    legend = {e["model"]: e for e in shown["legend"]}
    assert list(legend) == labels
    assert len({e["color"] for e in legend.values()}) == 2
    assert shown["bars"] == len(shown["rects"]) == sum(e["bars"] for e in legend.values())
    for label in labels:
        fills = {r["fill"] for r in shown["rects"] if r["model"] == label}
        assert len(fills) == 1 and rgb(fills.pop()) == legend[label]["color"]
        assert sum(r["model"] == label for r in shown["rects"]) == legend[label]["bars"] >= 1
    assert all(0 <= r["x"] <= 300 and r["width"] > 0 for r in shown["rects"])

    mem = shown["memory"]
    assert int(mem["budget"]) == BUDGET_MIB and 0 <= float(mem["used"]) <= BUDGET_MIB
    assert f"of {BUDGET_MIB} MiB" in mem["text"]
    assert "alpha/1" in mem["text"] and "beta/1" in mem["text"]  # each model's footprint
    assert mem["width"].endswith("%")
