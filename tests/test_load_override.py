"""A repository load with a config override (tritonclient's ``load_model(m, config=...)``),
over HTTP and gRPC, on a real server: a good override is applied and shown by
get_model_config; a bad one answers "failed to load: <reason>" and the running
version serves on; a load without one goes back to the file's entry; the config
file keeps the override unless it changes that model."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ServerProcess, model_entry, spec, start_server, write_config
from reload_helpers import config_status, rewrite_config, wait_attempts
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)

NEW_INPUT = {"name": "X", "data_type": "TYPE_FP32", "dims": [3]}
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def _affine(model_dir: Path, **extra: Any) -> dict[str, Any]:
    return model_entry(
        "affine", str(model_dir / "affine.pt"), [spec("INPUT0", "FP32", [16])],
        [spec("OUTPUT0", "FP32", [16])],
        batching={"max_batch_size": 32, "max_delay_ms": 2.0, "preferred_batch_sizes": [8, 16, 32]},
        **extra,
    )  # fmt: skip


def _config(model_dir: Path, **affine: Any) -> dict[str, Any]:
    return {"grpc": {"port": 0}, "models": [_affine(model_dir, **affine)]}


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("load_override")
    path = write_config(folder, _config(model_dir))
    # Not watched: the config file changes only where a test sends SIGHUP.
    srv = start_server(path, extra_args=("--watch-interval", "0"))
    yield srv, path
    srv.stop()


@pytest.fixture
def srv(served: Any) -> Iterator[ServerProcess]:
    """The server, its model loaded as the file says before and after each test."""
    server, _ = served
    client = httpclient.InferenceServerClient(server.url)
    client.load_model("affine")
    yield server
    client.load_model("affine")
    client.close()


@pytest.fixture
def http(srv: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(srv.url)
    yield client
    client.close()


@pytest.fixture
def grpc(srv: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    yield client
    client.close()


def _infer_http(client: httpclient.InferenceServerClient, x: np.ndarray = X) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("affine", [inp]).as_numpy("OUTPUT0")


def _infer_grpc(client: grpcclient.InferenceServerClient, x: np.ndarray = X) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("affine", [inp]).as_numpy("OUTPUT0")


def _batching(config: dict[str, Any]) -> tuple[int, list[int], int]:
    dyn = config.get("dynamic_batching", {})
    return (
        int(config["max_batch_size"]),
        [int(v) for v in dyn.get("preferred_batch_size", [])],
        int(dyn.get("max_queue_delay_microseconds", 0)),
    )


def _grpc_config(client: grpcclient.InferenceServerClient) -> dict[str, Any]:
    return client.get_model_config("affine", as_json=True)["config"]


def test_triton_form_from_get_model_config_is_applied_and_shown(http, grpc) -> None:
    before = _infer_http(http)
    config = http.get_model_config("affine")
    assert _batching(config) == (32, [8, 16, 32], 2000)
    config["max_batch_size"] = 8
    config["dynamic_batching"] = {
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 500,
    }
    http.load_model("affine", config=json.dumps(config))

    assert _batching(http.get_model_config("affine")) == (8, [4, 8], 500)
    assert _batching(_grpc_config(grpc)) == (8, [4, 8], 500)
    np.testing.assert_array_equal(_infer_http(http), before)
    # The new max_batch_size is the one requests meet.
    with pytest.raises(InferenceServerException, match="exceeds max_batch_size 8"):
        _infer_http(http, np.zeros((9, 16), np.float32))
    # A load without an override goes back to the file's entry.
    http.load_model("affine")
    assert _batching(http.get_model_config("affine")) == (32, [8, 16, 32], 2000)


def test_grpc_round_trip_of_its_own_json(grpc) -> None:
    """gRPC's JSON writes 64-bit integers as strings; sent back edited, it is taken."""
    config = _grpc_config(grpc)
    assert config["input"][0]["dims"] == ["16"]
    config["max_batch_size"] = 4
    config["dynamic_batching"] = {
        "preferred_batch_size": [2, 4],
        "max_queue_delay_microseconds": "0",
    }
    config["instance_group"][0]["count"] = 2
    grpc.load_model("affine", config=json.dumps(config))
    shown = _grpc_config(grpc)
    assert _batching(shown) == (4, [2, 4], 0)
    assert shown["instance_group"][0]["count"] == 2
    assert _infer_grpc(grpc).shape == (1, 16)


def test_aserve_form_over_grpc(grpc, model_dir: Path) -> None:
    entry = _affine(model_dir)
    del entry["name"]  # may be left out
    entry["batching"] = {"max_batch_size": 2, "max_delay_ms": 0.0}
    grpc.load_model("affine", config=json.dumps(entry))
    assert _batching(_grpc_config(grpc)) == (2, [], 0)
    assert _infer_grpc(grpc).shape == (1, 16)


def _bad_overrides(model_dir: Path) -> list[tuple[str, str, str]]:
    """(case, override text, words its refusal has)."""
    entry = _affine(model_dir)
    missing = {**entry, "path": str(model_dir / "no-such-model.pt")}
    junk = model_dir / "not-a-model.pt"
    junk.write_bytes(b"not a TorchScript archive")
    not_a_model = {**entry, "path": str(junk)}
    return [
        ("invalid JSON", '{"max_batch_size": 8', "is not valid JSON"),
        ("not an object", "[8]", "must be a JSON object"),
        ("bad field", json.dumps({"max_batch_size": 0}), "batching.max_batch_size: must be >= 1"),
        ("bad aserve field", json.dumps({**entry, "instances": 0}), "instances: must be >= 1"),
        ("unknown aserve key", json.dumps({**entry, "colour": "red"}), "colour: unknown key"),
        ("unknown Triton key", json.dumps({"sequence_batching": {}}), "sequence_batching"),
        ("a Triton key not taken", json.dumps({"input": [NEW_INPUT]}), "sets Triton's 'input'"),
        ("missing file", json.dumps(missing), "path: file not found"),
        ("not a model", json.dumps(not_a_model), "model 'affine/1' failed to load"),
        ("another name", json.dumps({**entry, "name": "other"}), "names model 'other'"),
        ("another version", json.dumps({**entry, "version": "7"}), "version 7"),
    ]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_override_fails_and_the_running_version_serves(
    protocol: str, srv: ServerProcess, model_dir: Path
) -> None:
    http = httpclient.InferenceServerClient(srv.url)
    grpc = grpcclient.InferenceServerClient(srv.grpc_url)
    client: Any = http if protocol == "http" else grpc
    infer = _infer_http if protocol == "http" else _infer_grpc
    want = infer(client)
    failures = []
    for case, text, words in _bad_overrides(model_dir):
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("affine", config=text)
        message = refused.value.message()
        if not message.startswith("failed to load: ") or words not in message:
            failures.append(f"{case}: {message!r}")
        # Right after, the version in force answers, as configured.
        np.testing.assert_array_equal(infer(client), want, err_msg=case)
        assert _batching(http.get_model_config("affine"))[0] == 32, case
    http.close()
    grpc.close()
    assert failures == []


def test_refusals_have_their_statuses(http, grpc, model_dir: Path) -> None:
    with pytest.raises(InferenceServerException) as bad:
        http.load_model("affine", config="{")
    assert bad.value.status() == "400"
    with pytest.raises(InferenceServerException) as bad:
        grpc.load_model("affine", config="{")
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as unknown:
        http.load_model("nosuch", config="{}")
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException, match="file:x"):
        http.load_model("affine", config="{}", files={"file:x": b"1"})
    with pytest.raises(InferenceServerException, match="file:x"):
        grpc.load_model("affine", config="{}", files={"file:x": b"1"})


def test_grpc_unload_and_load(grpc) -> None:
    grpc.unload_model("affine")
    assert not grpc.is_model_ready("affine")
    index = {m.name: (m.state, m.reason) for m in grpc.get_model_repository_index().models}
    assert index["affine"] == ("UNAVAILABLE", "unloaded")
    # Not loaded, Triton's form may give only the keys aserve takes.
    with pytest.raises(InferenceServerException, match="while the model is not loaded"):
        grpc.load_model("affine", config=json.dumps({"platform": "pytorch_libtorch"}))
    taken = {"max_batch_size": 16, "dynamic_batching": {"preferred_batch_size": [8, 16]}}
    grpc.load_model("affine", config=json.dumps(taken))
    assert grpc.is_model_ready("affine")
    assert _batching(_grpc_config(grpc))[0] == 16


def test_the_config_file_keeps_an_override_unless_it_changes_that_model(
    served: Any, http, model_dir: Path
) -> None:
    srv, path = served
    http.load_model("affine", config=json.dumps({"max_batch_size": 8, "dynamic_batching": {
        "preferred_batch_size": [8]}}))  # fmt: skip
    try:
        # Another model added: affine's override stays.
        other = {**_affine(model_dir), "name": "other"}
        before = config_status(srv.base)["reloads"]
        rewrite_config(path, {**_config(model_dir), "models": [_affine(model_dir), other]})
        srv.proc.send_signal(signal.SIGHUP)
        status = wait_attempts(srv.base, before)
        assert status["last_reload"]["result"] == "ok", status
        assert status["last_reload"]["changes"]["added"] == ["other/1"], status
        assert http.is_model_ready("other")
        assert _batching(http.get_model_config("affine"))[0] == 8
        # The file changes affine: its entry is the file's again.
        before = status["reloads"]
        changed = _affine(model_dir)
        changed["batching"] = {**changed["batching"], "max_delay_ms": 1.0}
        rewrite_config(path, {**_config(model_dir), "models": [changed, other]})
        srv.proc.send_signal(signal.SIGHUP)
        status = wait_attempts(srv.base, before)
        assert status["last_reload"]["result"] == "ok", status
        assert _batching(http.get_model_config("affine")) == (32, [8, 16, 32], 1000)
    finally:
        rewrite_config(path, _config(model_dir))
        before = config_status(srv.base)["reloads"]
        srv.proc.send_signal(signal.SIGHUP)
        wait_attempts(srv.base, before)
