"""GET /metrics: traffic over every protocol, then a scrape parsed with prometheus_client."""

from __future__ import annotations

import sys
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import orjson
import pytest
import tritonclient.grpc as grpcclient
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from helpers import grpc_input, sync_wait_for_stats
from prometheus_client.parser import text_string_to_metric_families

from aserve._proto import aserve_pb2 as apb
from aserve._proto import aserve_pb2_grpc as apb_grpc
from aserve.obs.metrics import NvmlSampler
from aserve.obs.stats import Histogram

pytestmark = pytest.mark.timeout(90)


def scrape(base: str, accept: str | None = None) -> tuple[str, dict[str, Any]]:
    """(content type, {sample name: {frozen labels: value}}) of one scrape."""
    req = urllib.request.Request(base + "/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
        content_type = r.headers["Content-Type"]
    samples: dict[str, Any] = {}
    if "openmetrics" in content_type:
        return content_type, samples
    assert text.endswith("\n")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return content_type, samples


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    return samples.get(name, {}).get(frozenset(labels.items()), 0.0)


def post(base: str, path: str, doc: dict[str, Any]) -> int:
    req = urllib.request.Request(base + path, data=orjson.dumps(doc), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def metrics_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("metrics")
    models = [
        model_entry("affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
                    [spec("OUTPUT0", "FP32", [16])]),
        model_entry("fussy", str(model_dir / "fussy.pt"), [spec("X", "FP32", [2])],
                    [spec("Y", "FP32", [2])]),
    ]  # fmt: skip
    srv = start_server(write_config(folder, {"grpc": {"port": 0}, "models": models}))
    yield srv
    srv.stop()


def test_counters_match_the_requests_sent(metrics_server: ServerProcess) -> None:
    base = metrics_server.base
    ok = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    bad = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1.0] * 3}]}
    fail = {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1.0, -1.0]}]}
    assert [post(base, "/v2/models/affine/infer", ok) for _ in range(5)] == [200] * 5
    assert [post(base, "/v2/models/affine/infer", bad) for _ in range(2)] == [400] * 2
    assert post(base, "/v2/models/nope/infer", ok) == 404
    assert [post(base, "/v2/models/fussy/infer", fail) for _ in range(3)] == [500] * 3

    client = grpcclient.InferenceServerClient(metrics_server.grpc_url)
    try:
        x = np.ones((1, 16), np.float32)
        for _ in range(4):
            client.infer("affine", [grpc_input("INPUT0", x)])
        with pytest.raises(grpcclient.InferenceServerException, match="negative input"):
            client.infer("fussy", [grpc_input("X", np.array([[1.0, -1.0]], np.float32))])
        results: list[Any] = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        for _ in range(2):
            client.async_stream_infer("affine", [grpc_input("INPUT0", x)])
        client.stop_stream()  # waits for the answers
        assert [error for _, error in results] == [None, None]
    finally:
        client.close()
    sync_wait_for_stats(base, "affine", lambda s: s["running_batch_count"] == 0)

    content_type, m = scrape(base)
    assert content_type.startswith("text/plain; version=0.0.4")
    total = "aserve_requests_total"

    def requests(model: str, protocol: str, status: str) -> float:
        return value(m, total, model=model, version="1" if model else "", protocol=protocol,
                     status=status)  # fmt: skip

    assert requests("affine", "http", "ok") == 5
    assert requests("affine", "http", "invalid_argument") == 2
    assert requests("", "http", "not_found") == 1
    assert requests("fussy", "http", "internal") == 3
    assert requests("affine", "grpc", "ok") == 6
    assert requests("fussy", "grpc", "internal") == 1
    assert sum(m[total].values()) == 18  # nothing else was counted

    affine = {"model": "affine", "version": "1"}
    assert value(m, "aserve_request_duration_seconds_count", **affine) == 11
    assert value(m, "aserve_request_duration_seconds_bucket", **affine, le="+Inf") == 11
    assert value(m, "aserve_request_duration_seconds_sum", **affine) > 0
    # Queue time per request that reached a batch; one compute time and size per batch.
    assert value(m, "aserve_queue_duration_seconds_count", **affine) == 11
    executions = value(m, "aserve_batch_executions_total", **affine)
    assert 1 <= executions <= 11  # warm-up batches are not counted
    assert value(m, "aserve_compute_duration_seconds_count", **affine) == executions
    assert value(m, "aserve_batch_size_count", **affine) == executions
    assert value(m, "aserve_batch_size_sum", **affine) == 11
    assert value(m, "aserve_inferences_total", **affine) == 11
    assert value(m, "aserve_queue_requests", **affine) == 0
    assert value(m, "aserve_running_batches", **affine) == 0
    assert value(m, "aserve_admission_margin_ratio", **affine) == 1.0  # nothing missed
    assert value(m, "aserve_rejected_requests_total", **affine, reason="queue_full") == 0
    buckets = [
        (float(dict(k)["le"]), v)
        for k, v in m["aserve_queue_duration_seconds_bucket"].items()
        if dict(k)["model"] == "affine"
    ]
    counts = [v for _, v in sorted(buckets)]
    assert counts == sorted(counts)  # cumulative
    # Sub-millisecond requests are resolved: the latency buckets start at 50 us.
    for family in ("request", "queue", "compute"):
        samples = m[f"aserve_{family}_duration_seconds_bucket"]
        bounds = sorted(float(dict(k)["le"]) for k in samples if dict(k)["model"] == "affine")
        assert bounds[:4] == [5e-05, 1e-04, 2.5e-04, 5e-04], family
    assert value(m, "aserve_config_reloads_total", result="ok") == 0
    assert "process_cpu_seconds_total" in m
    assert not any(name.startswith("aserve_gpu") for name in m)  # no NVML here
    assert "aserve_time_to_first_token_seconds_count" not in m  # no decoder model


def test_openmetrics_when_asked(metrics_server: ServerProcess) -> None:
    req = urllib.request.Request(
        metrics_server.base + "/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n") and "aserve_requests_total" in text


def test_histogram_buckets() -> None:
    """``le`` buckets: a value on a bound counts in that bound's bucket."""
    hist = Histogram((1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 4, 100):
        hist.observe(v)
    assert hist.counts == [2, 2, 2, 1]
    assert hist.cumulative() == [("1.0", 2), ("2.0", 4), ("4.0", 6), ("+Inf", 7)]
    assert hist.sum == pytest.approx(112.0)


def test_generation_metrics(decoder_server: ServerProcess) -> None:
    base = decoder_server.base
    _, before = scrape(base)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    whole = client.completions.create(model="gpt2", prompt="Hello", max_tokens=8, temperature=0)
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model="gpt2", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    chat_usage = chunks[-1].usage
    assert chat_usage is not None
    with pytest.raises(openai.BadRequestError):  # n over max_num_seqs: counted as a 400
        client.completions.create(model="gpt2", prompt="Hello", max_tokens=8, n=99)
    req = urllib.request.Request(
        base + "/v2/models/gpt2/generate",
        data=orjson.dumps({"text_input": "Hi", "max_tokens": 4}),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        generate_usage = orjson.loads(r.read())["usage"]
    with grpc.insecure_channel(decoder_server.grpc_url) as channel:
        stub = apb_grpc.GenerationStub(channel)
        sampling = apb.SamplingParameters(max_tokens=3, temperature=0)
        replies = list(stub.Generate(apb.GenerateRequest(model_name="gpt2", prompt="Hi",
                                                         sampling=sampling)))  # fmt: skip
        grpc_tokens = replies[-1].usage.completion_tokens
        assert grpc_tokens == sum(len(r.token_ids) for r in replies)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(apb.GenerateRequest(model_name="gpt2")))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    sync_wait_for_stats(base, "gpt2", lambda s: s["generation"]["running_sequence_count"] == 0)
    _, after = scrape(base)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    gpt2 = {"model": "gpt2", "version": "1"}
    total = "aserve_requests_total"
    assert delta(total, **gpt2, protocol="openai", status="ok") == 2
    # Refused while parsing, after the model was looked up (its limits bound the
    # parsing): labelled with the model.
    assert delta(total, **gpt2, protocol="openai", status="invalid_argument") == 1
    assert delta(total, **gpt2, protocol="http", status="ok") == 1
    assert delta(total, **gpt2, protocol="grpc", status="ok") == 1
    assert delta(total, **gpt2, protocol="grpc", status="invalid_argument") == 1
    tokens = delta("aserve_generation_tokens_total", **gpt2)
    # Every generated token counts, an end token included (as usage does).
    completions = 8 + chat_usage.completion_tokens + generate_usage["completion_tokens"]
    assert tokens == completions + grpc_tokens
    assert delta("aserve_prompt_tokens_total", **gpt2) > 0
    # One token per sequence per step: the first is timed from arrival, the rest between steps.
    assert delta("aserve_time_to_first_token_seconds_count", **gpt2) == 4
    assert delta("aserve_inter_token_latency_seconds_count", **gpt2) == tokens - 4
    assert value(after, "aserve_kv_cache_usage_ratio", **gpt2) == 0
    assert value(after, "aserve_running_sequences", **gpt2) == 0


class _FakeNvml(types.ModuleType):
    """Enough of pynvml for the sampler: one GPU, 50% busy, 1 of 4 GiB used."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return b"GPU-fake"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return types.SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return types.SimpleNamespace(used=1 << 30, total=4 << 30)


async def test_nvml_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = NvmlSampler(interval_s=0.01)
    assert sampler.start()
    assert sampler.samples == (("0", "GPU-fake", 0.5, float(1 << 30), float(4 << 30)),)
    await sampler.stop()
    assert fake.shut


async def test_nvml_absent_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler = NvmlSampler()
    assert not sampler.start()
    assert sampler.samples == ()
    await sampler.stop()
