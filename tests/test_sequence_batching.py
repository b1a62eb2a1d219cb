"""Sequence batching on a real server, with tritonclient (HTTP and gRPC, sync and aio)
unchanged: a python handler that sums per sequence (request.sequence.state) under both
strategies, a TorchScript model whose START/READY controls and implicit state the
server fills, several sequences interleaved from several clients at once, every
refusal on both protocols, a start waiting for a slot, and an idle sequence freed."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from conftest import HANDLERS, ServerProcess, spec, start_server, write_config
from helpers import sync_stats, sync_wait_for_stats
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)

IO = {"inputs": [spec("INPUT", "INT32", [1])], "outputs": [spec("OUTPUT", "INT32", [1])]}


def _handler(name: str, **sequence_batching: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "python",
        "handler": "accumulator:Accumulator",
        "inputs": [spec("INPUT", "INT32", [1])],
        "outputs": [spec("OUTPUT", "INT32", [1]), spec("SLOT", "INT32", [1])],
        "batching": {"max_batch_size": 4, "max_delay_ms": 5, "max_queue_size": 64},
        "sequence_batching": sequence_batching,
    }


def _torch_model(folder: Path) -> dict[str, Any]:
    import torch

    class Acc(torch.nn.Module):
        def forward(self, x, start, ready, state):  # type: ignore[no-untyped-def]
            total = state * (1 - start) + x * ready
            return total, total

    path = folder / "acc.pt"
    torch.jit.script(Acc()).save(str(path))
    return {
        "name": "acc_torch",
        "engine": "torch",
        "path": str(path),
        "inputs": [
            spec("INPUT", "INT32", [1]), spec("START", "INT32", [1]),
            spec("READY", "INT32", [1]), spec("STATE_IN", "INT32", [1]),
        ],
        "outputs": [spec("OUTPUT", "INT32", [1]), spec("STATE_OUT", "INT32", [1])],
        "batching": {"max_batch_size": 16, "max_delay_ms": 5},
        "sequence_batching": {
            "control_inputs": {"start": "START", "ready": "READY"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("sequences")
    shutil.copy(HANDLERS / "accumulator.py", folder / "accumulator.py")
    one = _handler("acc_one", max_sequence_idle_microseconds=600_000_000)
    one["batching"] = {"max_batch_size": 1, "max_queue_size": 1}
    config = {
        "grpc": {"port": 0},
        "models": [
            _handler("acc_direct", max_sequence_idle_microseconds=600_000_000),
            _handler("acc_oldest", strategy="oldest", max_candidate_sequences=16,
                     max_sequence_idle_microseconds=600_000_000),
            one,
            _handler("acc_idle", max_sequence_idle_microseconds=50_000),
            _torch_model(folder),
            {**_handler("plain"), "sequence_batching": None},
        ],
    }  # fmt: skip
    server = start_server(write_config(folder, config))
    yield server
    server.stop()


def _input(module: Any, value: int) -> Any:
    inp = module.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return inp


def _http_add(client: httpclient.InferenceServerClient, model: str, seq: Any, value: int,
              start: bool = False, end: bool = False, **kw: Any) -> int:  # fmt: skip
    result = client.infer(
        model, [_input(httpclient, value)], sequence_id=seq, sequence_start=start,
        sequence_end=end, **kw,
    )  # fmt: skip
    return int(result.as_numpy("OUTPUT")[0, 0])


def _grpc_add(client: grpcclient.InferenceServerClient, model: str, seq: Any, value: int,
              start: bool = False, end: bool = False) -> int:  # fmt: skip
    result = client.infer(
        model, [_input(grpcclient, value)], sequence_id=seq, sequence_start=start,
        sequence_end=end,
    )  # fmt: skip
    return int(result.as_numpy("OUTPUT")[0, 0])


def _active(srv: ServerProcess, model: str) -> int:
    return sync_stats(srv.base, model)["sequences_active"]


# --- running sums, interleaved ---------------------------------------------------------


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest", "acc_torch"])
def test_sequences_interleaved_from_several_http_clients(srv: ServerProcess, model: str) -> None:
    """Threads, each with its own client, interleave three sequences each (12 at once
    where there are slots for them all; acc_direct has 4: one thread); every answer is
    its sequence's running sum, and no batch holds two requests of one sequence."""
    values = list(range(1, 7))
    threads = 4 if model != "acc_direct" else 1  # direct has 4 slots: 1 thread x 3 sequences

    def client_run(t: int) -> dict[int, list[int]]:
        client = httpclient.InferenceServerClient(srv.url)
        ids = [1000 * (t + 1) + k + 1 for k in range(3)]
        got: dict[int, list[int]] = {i: [] for i in ids}
        try:
            for n, v in enumerate(values):
                for i in ids:
                    got[i].append(_http_add(
                        client, model, i, v * i % 97, start=n == 0, end=n == len(values) - 1,
                    ))  # fmt: skip
        finally:
            client.close()
        return got

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(client_run, range(threads)))
    for got in results:
        for i, sums in got.items():
            assert sums == list(np.cumsum([v * i % 97 for v in values])), (i, sums)
    sync_wait_for_stats(srv.base, model, lambda s: s["sequences_active"] == 0)


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest", "acc_torch"])
def test_sequences_interleaved_over_grpc_aio(srv: ServerProcess, model: str) -> None:
    """Eight grpc.aio clients at once, string and integer ids; sequences of one client
    run one after another, the clients' at the same time."""

    async def one(client: grpcaio.InferenceServerClient, seq: Any, n: int) -> list[int]:
        sums = []
        for k in range(n):
            result = await client.infer(
                model, [_input(grpcclient, k + 1)], sequence_id=seq, sequence_start=k == 0,
                sequence_end=k == n - 1,
            )  # fmt: skip
            sums.append(int(result.as_numpy("OUTPUT")[0, 0]))
        return sums

    async def run() -> list[list[int]]:
        clients = [grpcaio.InferenceServerClient(srv.grpc_url) for _ in range(4)]
        try:
            ids: list[Any] = [f"aio-{model}-{i}" for i in range(2)] + [7, 8]
            return await asyncio.gather(*(one(c, s, 5) for c, s in zip(clients, ids, strict=True)))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    for sums in asyncio.run(run()):
        assert sums == [1, 3, 6, 10, 15]
    sync_wait_for_stats(srv.base, model, lambda s: s["sequences_active"] == 0)


def test_grpc_sync_and_http_aio_share_a_sequence(srv: ServerProcess) -> None:
    """One sequence, its requests sent by different clients and protocols in turn."""
    import tritonclient.http.aio as httpaio

    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    http_client = httpclient.InferenceServerClient(srv.url)

    async def aio_add(value: int, end: bool) -> int:
        client = httpaio.InferenceServerClient(srv.url)
        try:
            result = await client.infer(
                "acc_direct", [_input(httpaio, value)], sequence_id="mixed", sequence_end=end
            )
            return int(result.as_numpy("OUTPUT")[0, 0])
        finally:
            await client.close()

    try:
        assert _grpc_add(grpc_client, "acc_direct", "mixed", 5, start=True) == 5
        assert _http_add(http_client, "acc_direct", "mixed", 2) == 7
        assert asyncio.run(aio_add(10, False)) == 17
        assert _grpc_add(grpc_client, "acc_direct", "mixed", 1, end=True) == 18
    finally:
        grpc_client.close()
        http_client.close()


def test_a_start_after_an_end_begins_at_zero_and_an_id_can_be_reused(srv: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(srv.url)
    try:
        for model in ("acc_direct", "acc_torch"):
            assert _http_add(client, model, 42, 3, start=True) == 3
            assert _http_add(client, model, 42, 4, end=True) == 7
            assert _http_add(client, model, 42, 10, start=True) == 10
            assert _http_add(client, model, 42, 1, start=False, end=True) == 11
            # A one-request sequence.
            assert _http_add(client, model, 43, 9, start=True, end=True) == 9
    finally:
        client.close()


# --- refusals --------------------------------------------------------------------------


def _http_refusal(
    srv: ServerProcess, model: str, parameters: dict[str, Any] | None
) -> tuple[int, str]:
    body: dict[str, Any] = {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}]
    }
    if parameters is not None:
        body["parameters"] = parameters
    req = urllib.request.Request(
        f"{srv.base}/v2/models/{model}/infer", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


@pytest.mark.parametrize("model", ["acc_direct", "acc_torch"])
def test_refusals_over_both_protocols(srv: ServerProcess, model: str) -> None:
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)

    def refused(call: Any, *args: Any, **kw: Any) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as exc:
            call(*args, **kw)
        return exc.value

    try:
        protocols = (
            (http, httpclient, _http_add, "400", 5000),
            (grpc, grpcclient, _grpc_add, "StatusCode.INVALID_ARGUMENT", 6000),
        )
        for proto, module, add, bad, base in protocols:
            # No sequence_id at all (tritonclient's default 0 sends none).
            e = refused(proto.infer, model, [_input(module, 1)])
            assert e.status() == bad
            assert "a request needs the parameter 'sequence_id'" in e.message()
            # Unknown: never started.
            e = refused(add, proto, model, base + 1, 1)
            assert e.status() == bad
            assert f"sequence {base + 1} of model '{model}/1' is unknown" in e.message()
            # A second start while it runs.
            assert add(proto, model, base + 2, 1, start=True) == 1
            e = refused(add, proto, model, base + 2, 1, start=True)
            assert e.status() == bad
            assert "is already started and has not ended" in e.message()
            assert add(proto, model, base + 2, 2, end=True) == 3  # the sequence went on
            # Ended.
            e = refused(add, proto, model, base + 2, 1)
            assert e.status() == bad
            assert "has ended (its sequence_end request came)" in e.message()
    finally:
        http.close()
        grpc.close()
    sync_wait_for_stats(srv.base, model, lambda s: s["sequences_active"] == 0)


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        (None, "a request needs the parameter 'sequence_id'"),
        ({"sequence_id": 1.5, "sequence_start": True}, "must be a positive integer or a non-empty string"),
        ({"sequence_id": True}, "must be a positive integer or a non-empty string"),
        ({"sequence_id": -3, "sequence_start": True}, "must be between 1 and 2**64 - 1"),
        # JSON past uint64 reads as a float.
        ({"sequence_id": 2**64, "sequence_start": True}, "must be a positive integer or a non-empty"),
        ({"sequence_id": 5, "sequence_start": "yes"}, "parameter 'sequence_start' must be true or false"),
        ({"sequence_id": "x" * 300, "sequence_start": True}, "at most 256"),
    ],
)  # fmt: skip
def test_bad_sequence_parameters_over_http(srv: ServerProcess, parameters: Any, says: str) -> None:
    status, message = _http_refusal(srv, "acc_direct", parameters)
    assert status == 400
    assert says in message


def test_the_largest_uint64_id_over_http(srv: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(srv.url)
    try:
        assert _http_add(client, "acc_direct", 2**64 - 1, 3, start=True, end=True) == 3
    finally:
        client.close()


def test_a_request_of_two_items_is_refused(srv: ServerProcess) -> None:
    body = {
        "inputs": [{"name": "INPUT", "shape": [2, 1], "datatype": "INT32", "data": [1, 2]}],
        "parameters": {"sequence_id": 9, "sequence_start": True},
    }
    req = urllib.request.Request(
        f"{srv.base}/v2/models/acc_direct/infer", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400
    assert "carries one item (batch dimension 1), got 2" in json.loads(exc.value.read())["error"]


# --- slots: waiting, refused, freed when idle --------------------------------------------


def test_a_start_waits_for_a_slot_until_its_deadline(srv: ServerProcess) -> None:
    """acc_one has one slot and room for one start waiting: a start whose deadline
    passes first is refused (503, UNAVAILABLE over gRPC), one more waiting than that is
    refused at once (429), and a waiting start gets the slot the moment its holder ends."""
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert _http_add(http, "acc_one", 1, 4, start=True) == 4
        with pytest.raises(InferenceServerException) as exc:
            _http_add(http, "acc_one", 2, 1, start=True, timeout=100_000)  # 100 ms
        assert exc.value.status() == "503"
        assert "no sequence slot came free within the request's deadline" in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            grpc.infer("acc_one", [_input(grpcclient, 1)], sequence_id=2, sequence_start=True,
                       client_timeout=None, timeout=100_000)  # fmt: skip
        assert exc.value.status() == "StatusCode.UNAVAILABLE"
        # A start that waits: seen in the statistics (open, no slot yet) before the end.
        answer: list[Any] = []

        def start_and_wait() -> None:
            client = httpclient.InferenceServerClient(srv.url)
            try:
                answer.append(
                    _http_add(client, "acc_one", 3, 8, start=True, end=True, timeout=60_000_000)
                )
            finally:
                client.close()

        waiter = threading.Thread(target=start_and_wait)
        waiter.start()
        sync_wait_for_stats(srv.base, "acc_one", lambda s: s["sequences_active"] == 2)
        with pytest.raises(InferenceServerException) as exc:
            _http_add(http, "acc_one", 4, 1, start=True)
        assert exc.value.status() == "429"
        assert "starts wait for one" in exc.value.message()
        assert _http_add(http, "acc_one", 1, 1, end=True) == 5
        waiter.join(30)
        assert answer == [8]
    finally:
        http.close()
        grpc.close()
    sync_wait_for_stats(srv.base, "acc_one", lambda s: s["sequences_active"] == 0)


def test_an_idle_sequence_is_freed(srv: ServerProcess) -> None:
    """acc_idle frees a sequence after 50 ms without a request: the gauge falls back
    (polled), and the sequence's next request is refused, saying why."""
    from test_handler_metrics import wait_value

    labels = {"model": "acc_idle", "version": "1"}
    client = httpclient.InferenceServerClient(srv.url)
    try:
        assert _http_add(client, "acc_idle", "lost", 2, start=True) >= 2
        wait_value(srv.base, "aserve_active_sequences", 0, **labels)
        with pytest.raises(InferenceServerException) as exc:
            _http_add(client, "acc_idle", "lost", 1)
        assert exc.value.status() == "400"
        assert "freed after being idle longer than max_sequence_idle_microseconds" in (
            exc.value.message()
        )
        assert _http_add(client, "acc_idle", "lost", 6, start=True) == 6  # a new one
    finally:
        client.close()


# --- what the model shows --------------------------------------------------------------


def test_a_model_without_sequence_batching_refuses_a_sequence_id(srv: ServerProcess) -> None:
    status, message = _http_refusal(srv, "plain", {"sequence_id": 3, "sequence_start": True})
    assert status == 501
    assert "model 'plain/1' does not serve sequences" in message


def test_config_and_metadata_show_sequence_batching(srv: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        config = client.get_model_config("acc_torch")
        assert [i["name"] for i in config["input"]] == ["INPUT"]  # the server fills the rest
        assert [o["name"] for o in config["output"]] == ["OUTPUT"]
        assert config["sequence_batching"] == {
            "max_sequence_idle_microseconds": 1_000_000,
            "direct": {},
            "control_input": [
                {"name": "START", "control": [
                    {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
                {"name": "READY", "control": [
                    {"kind": "CONTROL_SEQUENCE_READY", "int32_false_true": [0, 1]}]},
            ],
            "state": [{
                "input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_INT32",
                "dims": [1], "initial_state": [{"data_type": "TYPE_INT32", "dims": [1],
                                                "zero_data": True, "name": "STATE_IN_initial"}],
            }],
        }  # fmt: skip
        oldest = grpc.get_model_config("acc_oldest", as_json=True)["config"]
        assert oldest["sequence_batching"]["oldest"] == {"max_candidate_sequences": 16}
        meta = client.get_model_metadata("acc_torch")
        assert [i["name"] for i in meta["inputs"]] == ["INPUT"]
        assert [o["name"] for o in meta["outputs"]] == ["OUTPUT"]
    finally:
        client.close()
        grpc.close()
