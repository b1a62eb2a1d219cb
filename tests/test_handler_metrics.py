"""Custom metrics from python handlers (``context.metrics``): declared, bounded, exported.

Unit tests of :class:`aserve.obs.handler_metrics.MetricSet` (names, labels, the
cap, a worker's deltas crossing as msgpack), then a real server with the
``metered`` handler on threads and in a worker process, scraped on
``/metrics`` and read from the dashboard's stats. The page's charts of them
are in ``test_dashboard.py``.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
from conftest import ServerProcess, spec, start_server, write_config
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from reload_helpers import copy_handler
from stall_watch import watch_loop

from aserve.obs.handler_metrics import MAX_SERIES, MetricSet
from aserve.obs.metrics import handler_families

pytestmark = pytest.mark.timeout(120)


# --- the metric set ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "labels", "why"),
    [
        ("bad-name", [], "not valid"),
        ("9lives", [], "not valid"),
        ("with:colon", [], "not valid"),
        ("x" * 101, [], "not valid"),
        ("latency_sum", [], "reserves"),
        ("ok", ["model"], "reserved"),
        ("ok", ["le"], "reserved"),
        ("ok", ["__x"], "not valid"),
        ("ok", ["a", "a"], "repeat"),
        ("ok", [f"l{i}" for i in range(9)], "over the limit 8"),
        ("ok", "tag", "not a string"),
    ],
)
def test_names_and_labels_follow_prometheus_rules(name: str, labels: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        MetricSet("m", "1").counter(name, "help", labels)


def test_declarations_are_checked_and_idempotent() -> None:
    m = MetricSet("m", "1")
    a = m.counter("seen_total", "Seen.", ["kind"])
    m.counter("seen", "Seen.", ["kind"])  # the same metric: a handler loaded twice
    with pytest.raises(ValueError, match="already declared as a counter"):
        m.gauge("seen", "Seen.", ["kind"])
    with pytest.raises(ValueError, match="buckets must be finite and increasing"):
        m.histogram("h", "H.", buckets=[1, 1])
    with pytest.raises(ValueError, match="help must be text"):
        m.gauge("g", "")
    with pytest.raises(ValueError, match=r"call \.labels"):
        a.inc()
    with pytest.raises(ValueError, match="has labels \\['kind'\\], got \\['kond'\\]"):
        a.labels(kond="x")
    with pytest.raises(ValueError, match="must be finite, >= 0"):
        a.labels("x").inc(-1)
    for i in range(63):
        m.gauge(f"g{i}", "G.")
    with pytest.raises(ValueError, match="at most 64 metrics"):
        m.gauge("one_too_many", "G.")


def test_label_values_past_the_cap_fold_into_other(caplog: pytest.LogCaptureFixture) -> None:
    m = MetricSet("m", "1")
    c = m.counter("by_user", "Requests by user.", ["user", "route"])
    for i in range(MAX_SERIES + 30):
        c.labels(f"u{i}", "/x").inc()
    c.labels("u0", "/x").inc()  # a known combination still counts as itself
    c.labels("y" * 200, "/x").inc()  # an overlong value folds too
    (doc,) = m.snapshot()
    series = dict((tuple(k), v) for k, v in doc["series"])
    assert len(series) == MAX_SERIES + 1
    assert series[("other", "other")] == 31 and series[("u0", "/x")] == 2
    warnings = [r for r in caplog.records if "label-value combinations" in r.getMessage()]
    assert len(warnings) == 1 and "aserve_handler_by_user" in warnings[0].getMessage()


def test_a_workers_deltas_cross_as_msgpack() -> None:
    worker, server = MetricSet("m", "1", delta=True), MetricSet("m", "1")
    c = worker.counter("n", "N.", ["k"])
    g = worker.gauge("g", "G.")
    h = worker.histogram("h", "H.", buckets=[1.0, 2.0])
    front = server.gauge("g", "G.")  # the front's handler declared it too: the same metric
    front.set(100)

    def cross() -> None:
        drained = worker.drain()
        if drained is not None:
            server.apply(msgpack.unpackb(msgpack.packb(drained)))

    c.labels("a").inc(2)
    g.inc(5)  # an add, not a set: adds to what the server has
    h.observe(1.5)
    cross()
    assert worker.drain() is None  # nothing new, nothing to send
    c.labels("a").inc()
    g.set(7)
    g.dec(2)
    h.observe(9)
    cross()
    docs = {d["name"]: d for d in server.snapshot()}
    assert docs["aserve_handler_n"]["series"] == [(["a"], 3.0)]
    assert docs["aserve_handler_g"]["series"] == [([], 5.0)]
    assert docs["aserve_handler_h"]["series"] == [([], [[0, 1, 1], 10.5])]


def test_text_that_is_not_utf8_is_replaced_as_it_enters() -> None:
    """A lone surrogate in a label value or a help text (an undecodable byte of a
    multipart filename, say) becomes U+FFFD: the exposition and msgpack encode it."""
    worker, server = MetricSet("m", "1", delta=True), MetricSet("m", "1")
    c = worker.counter("files", "Files \udcff by name.", ["name"])
    c.labels("caf\udce9.jpg").inc()
    c.labels(name="\ud800").inc()
    server.apply(msgpack.unpackb(msgpack.packb(worker.drain())))
    (doc,) = server.snapshot()
    assert doc["help"] == "Files \ufffd by name."
    assert doc["series"] == [(["caf\ufffd.jpg"], 1.0), (["\ufffd"], 1.0)]
    registry = CollectorRegistry()

    class Handlers(Collector):
        def collect(self) -> Any:
            yield from handler_families([SimpleNamespace(name="m", version="1", label="m/1",
                                                         handler_metrics=server)])  # fmt: skip

    registry.register(Handlers())
    text = generate_latest(registry).decode()
    assert 'aserve_handler_files_total{model="m",name="caf\ufffd.jpg",version="1"} 1.0' in text


def test_a_conflicting_or_malformed_update_is_dropped_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = MetricSet("m", "1")
    server.counter("x", "X.")
    server.apply([[["x", "gauge", "X.", [], []]], [["x", [[[], [True, 1.0]]]]]])
    server.apply("junk")
    server.apply([[], [["x", [[["too", "many"], 1.0]]]]])
    (doc,) = server.snapshot()
    assert doc["series"] == []
    text = caplog.text
    assert "already declared as a counter" in text and "unreadable metrics" in text


# --- on a real server ------------------------------------------------------------------


def metered(name: str, executor: str) -> dict[str, Any]:
    return {
        "name": name, "engine": "python", "handler": "metered:Metered", "executor": executor,
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 1},
    }  # fmt: skip


@pytest.fixture(scope="module")
def metered_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("handler-metrics")
    copy_handler(folder, "metered")
    models = [metered("metered", "thread"), metered("metered_proc", "process")]
    srv = start_server(write_config(folder, {"models": models}))
    yield srv
    srv.stop()


def infer(tag: str, rows: int = 1) -> dict[str, Any]:
    return {
        "inputs": [{"name": "X", "shape": [rows, 2], "datatype": "FP32", "data": [1.5] * 2 * rows}],
        "parameters": {"tag": tag},
    }


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read()


def post(url: str, doc: dict[str, Any]) -> int:
    req = urllib.request.Request(url, data=orjson.dumps(doc), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def scrape(base: str) -> str:
    return get(base + "/metrics").decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every exposition line as (name, its labels) -> value, whatever the label order."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def wait_value(base: str, name: str, want: float, timeout: float = 30, **labels: str) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base)
        if value(text, name, **labels) == want:
            return text
        assert time.monotonic() < deadline, f"{name} {labels} never reached {want}:\n{text}"
        time.sleep(0.05)


@pytest.mark.parametrize(("model", "role"), [("metered", "both"), ("metered_proc", "infer")])
def test_handler_metrics_on_metrics_and_dashboard(
    metered_server: ServerProcess, model: str, role: str
) -> None:
    base = metered_server.base
    for tag, rows in (("a", 1), ("a", 2), ("b", 3)):
        assert post(f"{base}/v2/models/{model}/infer", infer(tag, rows)) == 200
    mv = {"model": model, "version": "1"}
    text = wait_value(base, "aserve_handler_items_total", 6.0, **mv, role=role)
    assert "# TYPE aserve_handler_requests_total counter" in text
    assert value(text, "aserve_handler_requests_total", **mv, tag="a") == 2.0
    assert value(text, "aserve_handler_requests_total", **mv, tag="b") == 1.0
    # Every row sums to 3.0: the (1, 10] bucket, cumulative from there on.
    assert value(text, "aserve_handler_row_sums_bucket", **mv, le="1.0") == 0.0
    assert value(text, "aserve_handler_row_sums_bucket", **mv, le="10.0") == 6.0
    assert value(text, "aserve_handler_row_sums_bucket", **mv, le="+Inf") == 6.0
    assert value(text, "aserve_handler_row_sums_sum", **mv) == 18.0
    # infer ran in the worker process, or in the server's own threads.
    pid = metered_server.worker_pid(model) if role == "infer" else metered_server.proc.pid
    assert value(text, "aserve_handler_infer_pid", **mv) == float(pid)
    if role == "infer":  # loaded twice: the front in the server, the worker's infer
        assert value(text, "aserve_handler_loaded", **mv, role="front") == 1.0
    assert value(text, "aserve_handler_loaded", **mv, role=role) == 1.0

    stats = orjson.loads(get(base + "/v2/dashboard/stats"))
    (entry,) = [m for m in stats["models"] if m["name"] == model]
    custom = {c["name"]: c for c in entry["custom"]}
    assert custom["aserve_handler_items"]["kind"] == "counter"
    assert custom["aserve_handler_items"]["total"] == 6.0
    assert custom["aserve_handler_requests"]["series"] == 2
    assert custom["aserve_handler_row_sums"]["counts"] == [0, 6, 0, 0]
    assert custom["aserve_handler_infer_pid"]["values"] == [["", float(pid)]]


@pytest.mark.parametrize("model", ["metered", "metered_proc"])
async def test_label_values_are_capped_on_a_server(
    metered_server: ServerProcess, model: str
) -> None:
    base = metered_server.base
    extra = 25
    async with (
        watch_loop(base),
        aiohttp.ClientSession(base) as client,
    ):
        for i in range(MAX_SERIES + extra):
            async with client.post(
                f"/v2/models/{model}/infer", json=infer(f"cap-{model}-{i}")
            ) as r:
                assert r.status == 200, await r.text()
    mv = {"model": model, "version": "1"}
    text = scrape(base)
    tags = [
        dict(labels)["tag"]
        for (name, labels) in samples(text)
        if name == "aserve_handler_requests_total" and ("model", model) in labels
    ]
    assert len(tags) == MAX_SERIES + 1 and "other" in tags
    # Tags other tests sent first took places of the cap: that many more are "other".
    earlier = sum(1 for t in tags if not t.startswith("cap-") and t != "other")
    assert value(text, "aserve_handler_requests_total", **mv, tag="other") == extra + earlier
    warned = [
        line for line in metered_server.log_text().splitlines()
        if "label-value combinations" in line and f"model {model}/1" in line
    ]  # fmt: skip
    assert len(warned) == 1, warned
