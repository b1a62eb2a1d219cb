"""``direct`` sequence batching with real batch slots, on a real server with tritonclient
(HTTP and gRPC, sync and aio): a TorchScript model that keeps each sequence's running
sum inside itself, in a buffer indexed by batch row (no implicit state), and reports
per answer its row, the batch's size and its READY column. From the answers alone:
each sequence stays on its row, padding rows have READY 0, a batch is as large as its
highest occupied row + 1, and with two instances each runs only its own sequences."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from conftest import ServerProcess, spec, start_server, write_config
from helpers import sync_stats, sync_wait_for_stats

pytestmark = pytest.mark.timeout(180)


def _rows_model(folder: Path) -> Path:
    """Per row: the running sum of its sequence (kept in the model's own buffer, reset by
    START, untouched where READY is 0), its row index, and for the whole batch
    ``size * 1000 + mask``, bit ``r`` of ``mask`` set where row ``r`` has READY 1."""
    import torch

    class Rows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("sums", torch.zeros(8, 1, dtype=torch.int32))

        def forward(self, x, start, ready):  # type: ignore[no-untyped-def]
            n = x.shape[0]
            old = self.sums[:n]
            new = torch.where(ready > 0, old * (1 - start) + x, old)
            self.sums[:n] = new
            rows = torch.arange(n, dtype=torch.int32).reshape(n, 1)
            mask = (ready * torch.pow(2, rows)).sum()
            batch = torch.full((n, 1), n * 1000, dtype=torch.int32) + mask.to(torch.int32)
            return new.clone(), rows, batch

    path = folder / "rows.pt"
    torch.jit.script(Rows()).save(str(path))
    return path


def _state_model(folder: Path) -> dict[str, Any]:
    """An accumulator with implicit state (initial 100) whose every row reports, for the
    whole batch, the state inputs of its padding rows (READY 0) summed, and their START,
    END and CORRID summed."""
    import torch

    class Pads(torch.nn.Module):
        def forward(self, x, start, end, ready, corrid, state):  # type: ignore[no-untyped-def]
            total = state * (1 - start) + x * ready
            idle = 1 - ready
            n = x.shape[0]
            pad_state = (state * idle).sum().to(torch.int32)
            pad_ctl = ((start + end) * idle).sum() + (corrid * idle.to(torch.int64)).sum()
            return (
                total, total, torch.full((n, 1), 1, dtype=torch.int32) * pad_state,
                torch.full((n, 1), 1, dtype=torch.int64) * pad_ctl,
            )  # fmt: skip

    path = folder / "pads.pt"
    torch.jit.script(Pads()).save(str(path))
    return {
        "name": "pads",
        "engine": "torch",
        "path": str(path),
        "inputs": [
            spec("INPUT", "INT32", [1]), spec("START", "INT32", [1]), spec("END", "INT32", [1]),
            spec("READY", "INT32", [1]), spec("CORRID", "INT64", [1]),
            spec("STATE_IN", "INT32", [1]),
        ],
        "outputs": [
            spec("OUTPUT", "INT32", [1]), spec("STATE_OUT", "INT32", [1]),
            spec("PAD_STATE", "INT32", [1]), spec("PAD_CTL", "INT64", [1]),
        ],
        "batching": {"max_batch_size": 4, "max_delay_ms": 5},
        "sequence_batching": {
            "control_inputs": {"start": "START", "end": "END", "ready": "READY", "corrid": "CORRID"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT", "initial_value": 100}],
            "max_sequence_idle_microseconds": 600_000_000,
        },
    }  # fmt: skip


def _model(name: str, path: Path, max_batch_size: int, instances: int) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "torch",
        "path": str(path),
        "instances": instances,
        "inputs": [
            spec("INPUT", "INT32", [1]), spec("START", "INT32", [1]), spec("READY", "INT32", [1]),
        ],
        "outputs": [
            spec("OUTPUT", "INT32", [1]), spec("ROW", "INT32", [1]), spec("BATCH", "INT32", [1]),
        ],
        "batching": {"max_batch_size": max_batch_size, "max_delay_ms": 5, "max_queue_size": 64},
        "sequence_batching": {
            "control_inputs": {"start": "START", "ready": "READY"},
            "max_sequence_idle_microseconds": 600_000_000,
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("direct")
    path = _rows_model(folder)
    config = {
        "grpc": {"port": 0},
        "models": [
            _model("rows_one", path, 4, 1),
            _model("rows_busy", path, 8, 1),
            # Its instances share the module (and its buffer): only rows and counts are read.
            _model("rows_two", path, 2, 2),
            _state_model(folder),
        ],
    }
    server = start_server(write_config(folder, config))
    yield server
    server.stop()


def _input(module: Any, value: int) -> Any:
    inp = module.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return inp


def _answer(result: Any) -> tuple[int, int, int, int]:
    """(running sum, row, batch size, READY mask) of one answer."""
    batch = int(result.as_numpy("BATCH")[0, 0])
    return (
        int(result.as_numpy("OUTPUT")[0, 0]), int(result.as_numpy("ROW")[0, 0]),
        batch // 1000, batch % 1000,
    )  # fmt: skip


def _http(client: httpclient.InferenceServerClient, model: str, seq: Any, value: int,
          start: bool = False, end: bool = False) -> tuple[int, int, int, int]:  # fmt: skip
    return _answer(client.infer(
        model, [_input(httpclient, value)], sequence_id=seq, sequence_start=start,
        sequence_end=end,
    ))  # fmt: skip


def _grpc(client: grpcclient.InferenceServerClient, model: str, seq: Any, value: int,
          start: bool = False, end: bool = False) -> tuple[int, int, int, int]:  # fmt: skip
    return _answer(client.infer(
        model, [_input(grpcclient, value)], sequence_id=seq, sequence_start=start,
        sequence_end=end,
    ))  # fmt: skip


def _batches(srv: ServerProcess, model: str) -> list[int]:
    return list(sync_stats(srv.base, model)["instance_batches"])


def test_each_request_sits_at_its_rows_and_the_rest_is_padding(srv: ServerProcess) -> None:
    """Three sequences started one after another take rows 0, 1, 2; a request of one of
    them alone makes a batch of its row + 1 rows, READY 1 on its row only; a sequence
    started after an end takes the freed row; the model's own sums stay apart."""
    client = httpclient.InferenceServerClient(srv.url)
    try:
        assert _http(client, "rows_one", 11, 5, start=True) == (5, 0, 1, 0b1)
        assert _http(client, "rows_one", 12, 7, start=True) == (7, 1, 2, 0b10)
        assert _http(client, "rows_one", 13, 1, start=True) == (1, 2, 3, 0b100)
        assert _http(client, "rows_one", 13, 2) == (3, 2, 3, 0b100)
        assert _http(client, "rows_one", 11, 1) == (6, 0, 1, 0b1)
        assert _http(client, "rows_one", 12, 3, end=True) == (10, 1, 2, 0b10)
        # Row 1 is free again: the next start takes it and starts at zero there.
        assert _http(client, "rows_one", 14, 4, start=True) == (4, 1, 2, 0b10)
        assert _http(client, "rows_one", 13, 10) == (13, 2, 3, 0b100)
        for seq in (11, 13, 14):
            _http(client, "rows_one", seq, 0, end=True)
    finally:
        client.close()
    sync_wait_for_stats(srv.base, "rows_one", lambda s: s["sequences_active"] == 0)


def test_sequences_interleaved_from_several_clients_keep_rows_and_sums(
    srv: ServerProcess,
) -> None:
    """Eight sequences from eight clients at once (HTTP threads and grpc.aio), the model's
    per-row buffer their only state: every answer is its sequence's running sum, each
    sequence keeps one row, the open sequences' rows differ, and each batch's size is
    its highest READY row + 1 with its own row among the READY ones."""
    values = [3, 1, 4, 1, 5, 9, 2, 6]

    def check(seq: Any, answers: list[tuple[int, int, int, int]], scale: int) -> int:
        sums = [a[0] for a in answers]
        assert sums == list(np.cumsum([v * scale for v in values])), (seq, answers)
        rows = {a[1] for a in answers}
        assert len(rows) == 1, (seq, answers)
        for _, row, size, mask in answers:
            assert mask >> row & 1, (seq, answers)
            assert size == mask.bit_length(), (seq, answers)  # highest occupied row + 1
        return rows.pop()

    def http_run(t: int) -> tuple[Any, list[tuple[int, int, int, int]]]:
        client = httpclient.InferenceServerClient(srv.url)
        seq = 100 + t
        try:
            got = [
                _http(client, "rows_busy", seq, v * (t + 1), start=k == 0)
                for k, v in enumerate(values)
            ]
        finally:
            client.close()
        return seq, got

    async def aio_run() -> list[tuple[Any, list[tuple[int, int, int, int]]]]:
        async def one(t: int) -> tuple[Any, list[tuple[int, int, int, int]]]:
            client = grpcaio.InferenceServerClient(srv.grpc_url)
            seq = f"aio-{t}"
            got = []
            try:
                for k, v in enumerate(values):
                    got.append(_answer(await client.infer(
                        "rows_busy", [_input(grpcclient, v * (t + 1))], sequence_id=seq,
                        sequence_start=k == 0,
                    )))  # fmt: skip
            finally:
                await client.close()
            return seq, got

        return await asyncio.gather(*(one(t) for t in range(4, 8)))

    with ThreadPoolExecutor(5) as pool:
        threads = [pool.submit(http_run, t) for t in range(4)]
        aio = pool.submit(asyncio.run, aio_run())
        results = [f.result() for f in threads] + aio.result()
    rows = [check(seq, got, t + 1) for t, (seq, got) in enumerate(results)]
    assert sorted(rows) == list(range(8))  # eight open sequences, eight rows of one instance
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        for seq, _ in results:
            _grpc(grpc_client, "rows_busy", seq, 0, end=True)
    finally:
        grpc_client.close()
    sync_wait_for_stats(srv.base, "rows_busy", lambda s: s["sequences_active"] == 0)


def test_two_instances_each_run_only_their_own_sequences(srv: ServerProcess) -> None:
    """max_batch_size 2, two instances: slots 0-1 are instance 0's rows 0-1, slots 2-3
    instance 1's. Requests of a sequence count as batches of its instance alone, at its
    row, over gRPC sync and HTTP aio alike."""
    client = grpcclient.InferenceServerClient(srv.grpc_url)

    async def aio(seq: Any, value: int, end: bool = False) -> tuple[int, int, int, int]:
        c = httpaio.InferenceServerClient(srv.url)
        try:
            return _answer(await c.infer(
                "rows_two", [_input(httpaio, value)], sequence_id=seq, sequence_end=end
            ))  # fmt: skip
        finally:
            await c.close()

    try:
        placed = [_grpc(client, "rows_two", f"s{k}", 1, start=True) for k in range(4)]
        # Slot k: row k % 2 of a batch that holds that row alone of its instance.
        assert [a[1:] for a in placed] == [(0, 1, 1), (1, 2, 2), (0, 1, 1), (1, 2, 2)]
        before = _batches(srv, "rows_two")
        for _ in range(3):
            assert _grpc(client, "rows_two", "s2", 1)[1:] == (0, 1, 1)
        assert asyncio.run(aio("s3", 1))[1:] == (1, 2, 2)
        after = _batches(srv, "rows_two")
        assert [b - a for a, b in zip(before, after, strict=True)] == [0, 4]
        assert _grpc(client, "rows_two", "s1", 1)[1:] == (1, 2, 2)
        assert asyncio.run(aio("s0", 1))[1:] == (0, 1, 1)
        last = _batches(srv, "rows_two")
        assert [b - a for a, b in zip(after, last, strict=True)] == [2, 0]
        for k in range(4):
            _grpc(client, "rows_two", f"s{k}", 0, end=True)
    finally:
        client.close()
    sync_wait_for_stats(srv.base, "rows_two", lambda s: s["sequences_active"] == 0)


def test_padding_rows_hold_the_idle_sequences_state_or_the_initial_value(
    srv: ServerProcess,
) -> None:
    """A padding row's state input is the kept state of the idle sequence on its row, or
    the initial value (100) on a free row; its START, END and CORRID are 0."""
    client = httpclient.InferenceServerClient(srv.url)

    def add(seq: int, value: int, **kw: bool) -> tuple[int, int, int]:
        result = client.infer(
            "pads", [_input(httpclient, value)], sequence_id=seq,
            sequence_start=kw.get("start", False), sequence_end=kw.get("end", False),
        )  # fmt: skip
        return (
            int(result.as_numpy("OUTPUT")[0, 0]), int(result.as_numpy("PAD_STATE")[0, 0]),
            int(result.as_numpy("PAD_CTL")[0, 0]),
        )  # fmt: skip

    try:
        assert add(71, 5, start=True) == (5, 0, 0)  # row 0, no padding
        assert add(72, 1, start=True) == (1, 5, 0)  # row 1; row 0 holds 71's kept 5
        assert add(71, 1, end=True) == (6, 0, 0)  # row 0 alone; its slot is freed
        assert add(72, 2) == (3, 100, 0)  # row 0 is free: the initial value
        assert add(72, 0, end=True) == (3, 100, 0)
    finally:
        client.close()
    sync_wait_for_stats(srv.base, "pads", lambda s: s["sequences_active"] == 0)
