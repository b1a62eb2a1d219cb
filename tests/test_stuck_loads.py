"""Models whose load, warm-up or batch never ends: the server stays in charge.

A TorchScript ``forward`` that loops forever (``while`` over a tensor whose
sum never drops) and a handler whose ``load`` waits on an event nobody sets
are real models that never return, on a machine of any speed. Each load is
bounded by ``load_timeout_s`` and fails with that reason; the reloader takes
a later config while one hangs; SIGTERM ends the server within
``drain_grace_s + drain_timeout_s + STOP_MARGIN_S``, with status 1 when a
thread stuck in a model had to be left running (a worker process is killed
instead). Events are ordered by what the server reports (the repository
index and ``/v2/config/status`` say what a load is doing), never by sleeps.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from archive_helpers import ROWS, pack, relabelled, scaffold, swap_in, with_files
from conftest import HANDLERS, ServerProcess, spec, start_server
from models import Affine, _script_save
from reload_helpers import get_json, rewrite_config, wait_log, wait_status

from aserve.server import STOP_MARGIN_S

pytestmark = pytest.mark.timeout(180)

X4 = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]}
ONES = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]}
# Small, so that the tests run fast, but over what loading these tiny models takes on
# a busy machine. Where a timeout could fire before the warm-up began, the tests
# assert what follows from the step the server says it timed out in.
LOAD_TIMEOUT_S = 3
TIMED_OUT = (
    f"failed to load: load and warm-up did not finish within load_timeout_s ({LOAD_TIMEOUT_S} s)"
)
AFFINE_IN = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}  # fmt: skip


class LoopForever(torch.nn.Module):
    """Never returns: ``y`` grows until float32 stops it, and its sum stays above -1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        while bool(y.sum() > -1.0):
            y = y + 1.0
        return y


class LoopOnPositive(torch.nn.Module):
    """``2 x``, but never returns when ``x[0, 0] > 0`` (warm-up sends zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        if bool(x[0, 0] > 0.0):
            while bool(y.sum() > -1.0):
                y = y + 1.0
        return y


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stuck")
    _script_save(LoopForever(), root / "loop.pt")
    _script_save(LoopOnPositive(), root / "loop_on_positive.pt")
    _script_save(Affine(), root / "affine.pt")
    return root


def _torch(name: str, path: Path, executor: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name, "engine": "torch", "path": str(path), "executor": executor,
        "inputs": [spec("X", "FP32", [4])], "outputs": [spec("Y", "FP32", [4])], **extra,
    }  # fmt: skip


def _affine(folder: Path, name: str = "affine") -> dict[str, Any]:
    return {
        "name": name, "engine": "torch", "path": str(folder / "affine.pt"),
        "inputs": [spec("INPUT0", "FP32", [16])], "outputs": [spec("OUTPUT0", "FP32", [16])],
    }  # fmt: skip


def _hangs(folder: Path, executor: str, hang_in: list[str], tag: str = "") -> dict[str, Any]:
    """The handler model; its load touches ``began-{executor}{tag}-{role}`` in ``folder``."""
    return {
        "name": "hangs", "engine": "python", "handler": "hangs:Hangs", "executor": executor,
        "parameters": {"began": str(folder / f"began-{executor}{tag}"), "hang_in": hang_in},
        "inputs": [spec("X", "FP32", [2])], "outputs": [spec("Y", "FP32", [1])],
    }  # fmt: skip


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"drain_grace_s": 0, "drain_timeout_s": 1, **config}))
    return path


def _post(url: str, doc: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(doc or {}).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post_quietly(server: ServerProcess, doc: dict[str, Any]) -> None:
    """An inference request whose answer does not matter (the server may be gone)."""
    try:
        _post(f"{server.base}/v2/models/loop/infer", doc, 120)
    except OSError:
        pass


def _wait_index(server: ServerProcess, model: str, check: Any, timeout: float = 60) -> dict:
    """Poll the repository index until ``model``'s entry satisfies ``check``."""
    deadline = time.monotonic() + timeout
    while True:
        status, index = _post(f"{server.base}/v2/repository/index")
        assert status == 200, index
        entry = next((e for e in index if e["name"] == model), None)
        if entry is not None and check(entry):
            return entry
        assert time.monotonic() < deadline, f"index never got there: {index}\n{server.log_text()}"
        assert server.proc.poll() is None, server.log_text()
        time.sleep(0.02)


def _wait_file(path: Path, server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log_text()
        time.sleep(0.02)


def _stop_within_bound(server: ServerProcess, drain_timeout_s: float = 1.0) -> tuple[int, float]:
    """SIGTERM; the exit status and how long it took, which must be within the
    documented bound (drain_grace_s is 0 in these configs)."""
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    bound = drain_timeout_s + STOP_MARGIN_S
    try:
        rc = server.proc.wait(bound)
    except subprocess.TimeoutExpired:
        _kill(server)
        raise AssertionError(
            f"still running {bound} s after SIGTERM:\n{server.log_text()}"
        ) from None
    return rc, time.monotonic() - t0


def _status_after_stop(log: str, stuck_in_warm_up: bool, executor: str, model: str = "loop") -> int:
    """The exit status a stop must give: 1 when a thread could not be stopped. A
    warm-up stuck on a thread executor is such a thread; a worker process is killed."""
    if stuck_in_warm_up and executor == "thread":
        assert f"instance 0 of model '{model}', in a batch" in log, log
    left = "could not be stopped" in log
    assert left or not (stuck_in_warm_up and executor == "thread"), log
    return 1 if left else 0


# --- the config -------------------------------------------------------------------


def test_load_timeout_s_is_the_models_else_the_servers():
    from aserve.config import parse_config

    model = {"name": "m", "engine": "torch", "path": "m.pt", "inputs": [spec("X", "FP32", [4])],
             "outputs": [spec("Y", "FP32", [4])]}  # fmt: skip
    config = parse_config({"models": [model, {**model, "name": "n", "load_timeout_s": 2.5}]})
    assert config.load_timeout_s == 600  # ten minutes unless the config says
    assert [config.load_timeout_of(m) for m in config.models] == [600, 2.5]
    config = parse_config({"load_timeout_s": 30, "models": [model]})
    assert config.load_timeout_of(config.models[0]) == 30


@pytest.mark.parametrize("value", [0, -1, "inf", 1e400])
def test_a_load_timeout_must_be_a_positive_number(value):
    from aserve.config import ConfigError, parse_config

    model = {"name": "m", "engine": "torch", "path": "m.pt", "inputs": [spec("X", "FP32", [4])],
             "outputs": [spec("Y", "FP32", [4])], "load_timeout_s": value}  # fmt: skip
    with pytest.raises(ConfigError, match=r"models\[0\]\.load_timeout_s"):
        parse_config({"models": [model]})
    with pytest.raises(ConfigError, match=r"load_timeout_s"):
        parse_config({"load_timeout_s": value, "models": []})


def test_a_changed_load_timeout_applies_in_place():
    from aserve.config import ModelConfig
    from aserve.loop.runtimes.batched import ModelRuntime
    from aserve.loop.runtimes.generation import GenerationRuntime

    m = ModelConfig(name="m", engine="torch", path="m.pt", inputs=[spec("X", "FP32", [4])],
                    outputs=[spec("Y", "FP32", [4])])  # fmt: skip
    assert ModelRuntime.reconfigurable(m, m.model_copy(update={"load_timeout_s": 5.0}))
    assert not ModelRuntime.reconfigurable(m, m.model_copy(update={"path": "n.pt"}))
    d = ModelConfig(name="d", engine="decoder", path="builtin:tiny-gpt2")
    assert GenerationRuntime.reconfigurable(d, d.model_copy(update={"load_timeout_s": 5.0}))
    assert not GenerationRuntime.reconfigurable(d, d.model_copy(update={"dtype": "float16"}))


# --- at startup -------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_warm_up_past_load_timeout_fails_startup_naming_it(folder, tmp_path, executor):
    """Before: live 200 and ready 503 forever. Now: exit 1 once load_timeout_s passed."""
    model = _torch("loop", folder / "loop.pt", executor, load_timeout_s=LOAD_TIMEOUT_S)
    path = _write(tmp_path / "config.json", {"models": [_affine(folder), model]})
    proc = subprocess.run(
        [sys.executable, "-m", "aserve", "--config", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"aserve: error: model 'loop/1' {TIMED_OUT}; it was " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # A thread stuck in the warm-up is left running, and the log says so.
    _status_after_stop(proc.stderr, "it was warming up" in proc.stderr, executor)


@pytest.mark.parametrize(
    ("kind", "executor", "status"),
    [("torch", "thread", 1), ("torch", "process", 0), ("handler", "thread", 1),
     ("handler", "process", 0)],
)  # fmt: skip
def test_sigterm_while_a_load_never_ends_stops_the_server(folder, tmp_path, kind, executor, status):
    """Before: two SIGTERMs left it alive. Now it stops within the bound; status 1
    when a thread stuck in the model had to be left, 0 when a worker was killed."""
    if kind == "torch":
        model = _torch("loop", folder / "loop.pt", executor)
    else:  # a process's front loads fine; its worker's load hangs
        model = _hangs(folder, executor, ["both"] if executor == "thread" else ["infer"])
        shutil.copy(HANDLERS / "hangs.py", tmp_path / "hangs.py")  # beside the config
    path = _write(tmp_path / "config.json", {"models": [model]})  # load_timeout_s: 600
    server = start_server(path, ready=False)
    try:
        name = model["name"]
        if kind == "torch":
            entry = _wait_index(server, name, lambda e: "warming up" in e["reason"])
        else:
            _wait_file(
                folder / f"began-{executor}-{'both' if executor == 'thread' else 'infer'}", server
            )
            entry = _wait_index(server, name, lambda e: e["state"] == "LOADING")
        assert entry["state"] == "LOADING" and "load_timeout_s 600 s" in entry["reason"], entry
        assert get_json(f"{server.base}/v2/health/live")[0] == 200
        assert get_json(f"{server.base}/v2/health/ready")[0] == 503
        rc, _ = _stop_within_bound(server)
        log = server.log_text()
        assert rc == status, log
        assert "stopping while the models load: their loads are given up" in log, log
        assert ("could not be stopped" in log) == (status == 1), log
    finally:
        _kill(server)


def test_a_second_sigterm_ends_the_server_at_once(folder, tmp_path):
    model = _torch(
        "loop", folder / "loop_on_positive.pt", "process", batching={"timeout_ms": 60000}
    )
    path = _write(tmp_path / "config.json", {"drain_timeout_s": 60, "models": [model]})
    server = start_server(path)
    try:
        worker = server.worker_pid("loop")
        # A request the worker never answers keeps the drain waiting its 60 s.
        sender = threading.Thread(target=_post_quietly, args=(server, ONES), daemon=True)
        sender.start()
        _wait_stats(server, "loop", lambda s: s["running_batch_count"] == 1)
        server.proc.send_signal(signal.SIGTERM)
        wait_log(server, "listeners closed; answering the requests in flight")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 1, server.log_text()
        log = server.log_text()
        assert "second SIGTERM: stopping without waiting for in-flight requests" in log, log
        _wait_gone(worker)  # killed with the server, not left stuck in the model
    finally:
        _kill(server)


# --- on a reload --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "executor"),
    [("torch", "thread"), ("torch", "process"), ("handler", "thread"), ("handler", "process")],
)
def test_a_reload_past_load_timeout_is_rejected_and_a_fixed_config_applies(
    folder, tmp_path, kind, executor
):
    path = tmp_path / "config.json"
    base = {"drain_timeout_s": 1}
    rewrite_config(path, {**base, "models": [_affine(folder)]})
    server = start_server(path, extra_args=("--watch-interval", "0.1"))
    try:
        if kind == "torch":
            name = "loop"
            stuck = _torch(name, folder / "loop.pt", executor, load_timeout_s=LOAD_TIMEOUT_S)
            fixed = _torch(name, folder / "loop_on_positive.pt", executor)
            request = X4
        else:  # the handler's load(context) never returns, in every role
            name = "hangs"
            shutil.copy(HANDLERS / "hangs.py", tmp_path / "hangs.py")
            stuck = {**_hangs(tmp_path, executor, ["both", "front", "infer"]),
                     "load_timeout_s": LOAD_TIMEOUT_S}  # fmt: skip
            fixed = _hangs(tmp_path, executor, [], tag="-fixed")
            request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2],
                                   "data": [1.0, 2.0]}]}  # fmt: skip
        rewrite_config(path, {**base, "models": [_affine(folder), stuck]})
        doc = wait_status(server.base, lambda s: s["reloads"]["rejected"] == 1, 60)
        error = doc["last_error"]["error"]
        assert f"models[1]: model '{name}/1' {TIMED_OUT}; it was " in error, doc
        assert doc["in_progress"] is None, doc
        # The other model served all along, and the server stayed ready.
        assert _post(f"{server.base}/v2/models/affine/infer", AFFINE_IN)[0] == 200
        assert get_json(f"{server.base}/v2/health/ready")[0] == 200
        # The reloader takes the next config: the same model, fixed.
        digest = rewrite_config(path, {**base, "models": [_affine(folder), fixed]})
        doc = wait_status(server.base, lambda s: s["config_hash"] == digest, 60)
        assert doc["last_reload"]["result"] == "ok", doc
        assert doc["last_reload"]["changes"]["added"] == [f"{name}/1"], doc
        code, answer = _post(f"{server.base}/v2/models/{name}/infer", request)
        assert code == 200, answer
        rc, _ = _stop_within_bound(server)
        log = server.log_text()
        if kind == "torch":
            assert rc == _status_after_stop(log, "it was warming up" in error, executor)
        else:
            # A load(context) that began never ends: on a thread of this process it is
            # left running (status 1); in a worker process, killed with it.
            hung_here = tmp_path / f"began-{executor}-{'both' if executor == 'thread' else 'front'}"
            assert rc == (1 if hung_here.exists() else 0), log
            assert ("could not be stopped" in log) == (rc == 1), log
    finally:
        _kill(server)


def test_a_newer_config_supersedes_a_load_that_never_ends(folder, tmp_path):
    """While a load hangs (default load_timeout_s: 10 minutes), SIGHUP and the
    repository API answer, and a fixed config takes over at once."""
    path = tmp_path / "config.json"
    base = {"drain_timeout_s": 1}
    rewrite_config(path, {**base, "models": [_affine(folder)]})
    server = start_server(path, extra_args=("--watch-interval", "0.1"))
    try:
        stuck = _torch("loop", folder / "loop.pt", "thread")
        rewrite_config(path, {**base, "models": [_affine(folder), stuck]})
        doc = wait_status(
            server.base,
            lambda s: (
                s["in_progress"] is not None
                and any("warming up" in m["step"] for m in s["in_progress"]["loading"])
            ),
            60,
        )
        loading = doc["in_progress"]["loading"][0]
        assert loading["name"] == "loop" and loading["load_timeout_s"] == 600, doc
        # SIGHUP answers: that config is being applied already.
        server.proc.send_signal(signal.SIGHUP)
        wait_log(server, "SIGHUP: that config is being applied already")
        # The repository API answers too, naming the load that holds it.
        t0 = time.monotonic()
        code, answer = _post(f"{server.base}/v2/repository/models/affine/load")
        assert code == 503, answer
        assert "another change is being applied" in answer["error"], answer
        assert "model 'loop/1': warming up" in answer["error"], answer
        assert time.monotonic() - t0 < 30, "the repository load waited too long"
        # Serving and ready meanwhile: the model being loaded is not routed yet.
        assert _post(f"{server.base}/v2/models/affine/infer", AFFINE_IN)[0] == 200
        assert get_json(f"{server.base}/v2/health/ready")[0] == 200
        # A fixed config supersedes the hung load.
        fixed = _torch("loop", folder / "loop_on_positive.pt", "thread")
        digest = rewrite_config(path, {**base, "models": [_affine(folder), fixed]})
        doc = wait_status(server.base, lambda s: s["config_hash"] == digest, 60)
        assert doc["last_reload"]["result"] == "ok", doc
        assert doc["reloads"]["rejected"] == 1, doc
        assert "given up: superseded by a newer config (file change)" in doc["last_error"]["error"]
        assert _post(f"{server.base}/v2/models/loop/infer", X4)[0] == 200
        # Its thread is still stuck in the model: left running, and the status says so.
        rc, _ = _stop_within_bound(server)
        assert rc == 1, server.log_text()
        assert "instance 0 of model 'loop', in a batch" in server.log_text()
    finally:
        _kill(server)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_repository_load_past_load_timeout_fails_and_the_old_version_serves(
    folder, tmp_path, executor
):
    weights = tmp_path / "m.pt"
    shutil.copy(folder / "loop_on_positive.pt", weights)
    path = tmp_path / "config.json"
    base = {"drain_timeout_s": 1}
    rewrite_config(path, {**base, "models": [_torch("m", weights, executor)]})
    server = start_server(path, extra_args=("--watch-interval", "0.1"))
    try:
        # A load timeout of its own applies in place: no new runtime is loaded for it.
        short = _torch("m", weights, executor, load_timeout_s=LOAD_TIMEOUT_S)
        digest = rewrite_config(path, {**base, "models": [short]})
        doc = wait_status(server.base, lambda s: s["config_hash"] == digest, 60)
        assert doc["last_reload"]["changes"]["reconfigured"] == ["m/1"], doc
        shutil.copy(folder / "loop.pt", weights)  # its files now hold a model that never returns
        code, answer = _post(f"{server.base}/v2/repository/models/m/load")
        assert code == 500, answer
        assert f"model 'm/1' {TIMED_OUT}; it was " in answer["error"], answer
        entry = _wait_index(server, "m", lambda e: True)
        assert entry["state"] == "READY", entry  # the version loaded before still serves
        assert _post(f"{server.base}/v2/models/m/infer", X4)[0] == 200
        # Unloaded, then loaded from the same files: the index says why it is not served.
        assert _post(f"{server.base}/v2/repository/models/m/unload")[0] == 200
        code, again = _post(f"{server.base}/v2/repository/models/m/load")
        assert code == 500 and TIMED_OUT in again["error"], again
        entry = _wait_index(server, "m", lambda e: True)
        assert entry["state"] == "UNAVAILABLE", entry
        assert entry["reason"].startswith(f"{TIMED_OUT}; it was "), entry
        shutil.copy(folder / "loop_on_positive.pt", weights)
        assert _post(f"{server.base}/v2/repository/models/m/load")[0] == 200
        assert _wait_index(server, "m", lambda e: True)["state"] == "READY"
        rc, _ = _stop_within_bound(server)
        warm_up = any("it was warming up" in a["error"] for a in (answer, again))
        assert rc == _status_after_stop(server.log_text(), warm_up, executor, "m")
    finally:
        _kill(server)


def test_a_repository_load_whose_handler_import_never_returns_fails_within_the_bound(
    tmp_path: Path,
) -> None:
    """An archive replaced in place by one whose handler module never finishes its
    import. Before: the repository load read the archive and imported the handler
    on a thread with no bound, so the call never answered and held the change slot
    (and the exit's join) for good; the import lock it held kept any other handler
    from importing. Now: 500 naming the bound once load_timeout_s passed, the old
    content serves on, a fixed archive loads at once, and SIGTERM ends the server
    (status 1: the import's thread could not be stopped)."""
    work = tmp_path / "work"
    work.mkdir()
    project = scaffold(work)
    good = pack(project, work / "good.aserve")
    fixed = pack(relabelled(project, work, "fixed"), work / "fixed.aserve")
    source = (project / "handler.py").read_bytes()
    hangs = with_files(good, work / "hangs.aserve", {
        "handler.py": source + b"\nimport threading\nthreading.Event().wait()  # never set\n",
    })  # fmt: skip
    served = tmp_path / "iris.aserve"
    shutil.copy(good, served)
    path = tmp_path / "config.json"
    entry = {"name": "iris", "path": "iris.aserve"}
    _write(path, {"models": [entry]})
    server = start_server(
        path, extra_env={"ASERVE_CACHE_DIR": str(tmp_path / "cache")},
        extra_args=("--watch-interval", "0"),
    )  # fmt: skip
    load = f"{server.base}/v2/repository/models/iris/load"
    try:
        # Its own load timeout, applied in place (the startup load had the default).
        _write(path, {"models": [{**entry, "load_timeout_s": LOAD_TIMEOUT_S}]})
        server.proc.send_signal(signal.SIGHUP)
        doc = wait_status(server.base, lambda s: s["reloads"]["ok"] == 1, 60)
        assert doc["last_reload"]["changes"]["reconfigured"] == ["iris/1"], doc

        swap_in(hangs, served)
        t0 = time.monotonic()
        code, answer = _post(load, timeout=60)
        took = time.monotonic() - t0
        assert code == 500, answer
        assert (
            f"checking model 'iris' did not finish within load_timeout_s ({LOAD_TIMEOUT_S} s): "
            "importing a handler module has not returned" in answer["error"]
        ), answer
        assert took < 30, f"answered after {took:.1f} s"  # never, before
        doc = wait_status(server.base, lambda s: s["in_progress"] is None, 10)
        assert doc["last_reload"]["result"] == "rejected", doc
        assert _label(server) == "setosa"  # the content loaded before serves on

        # The reloader takes the next change: the archive fixed loads at once.
        swap_in(fixed, served)
        code, answer = _post(load, timeout=60)
        assert code == 200, answer
        assert _label(server) == "fixed"
        rc, _ = _stop_within_bound(server)
        log = server.log_text()
        assert rc == 1, log
        assert "checking model 'iris'" in log and "could not be stopped" in log, log
    finally:
        _kill(server)


def _label(server: ServerProcess) -> str:
    body = {"inputs": [{"name": "FEATURES", "datatype": "FP32", "shape": [1, 4],
                        "data": ROWS[:4]}]}  # fmt: skip
    code, answer = _post(f"{server.base}/v2/models/iris/infer", body)
    assert code == 200, answer
    return next(o for o in answer["outputs"] if o["name"] == "LABEL")["data"][0]


# --- at request time ------------------------------------------------------------


@pytest.mark.parametrize(("executor", "status"), [("thread", 1), ("process", 0)])
def test_a_forward_that_never_returns_answers_by_its_deadline_and_sigterm_ends(
    folder, tmp_path, executor, status
):
    model = _torch("loop", folder / "loop_on_positive.pt", executor, batching={"timeout_ms": 500})
    path = _write(tmp_path / "config.json", {"models": [model, _affine(folder)]})
    server = start_server(path)
    try:
        worker = server.worker_pid("loop") if executor == "process" else None
        code, answer = _post(f"{server.base}/v2/models/loop/infer", ONES)
        assert code == 504, answer
        assert "still running its batch" in answer["error"], answer
        assert _post(f"{server.base}/v2/models/affine/infer", AFFINE_IN)[0] == 200
        rc, _ = _stop_within_bound(server)
        assert rc == status, server.log_text()
        if worker is not None:
            _wait_gone(worker)
    finally:
        _kill(server)


def _kill(server: ServerProcess) -> None:
    """A server a failed test leaves running, and its children first: a worker stuck
    in the model would not see its pipe close."""
    import psutil

    if server.proc.poll() is not None:
        return
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        child.kill()
    server.proc.kill()
    server.proc.wait(30)


def _wait_stats(server: ServerProcess, model: str, check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code, doc = get_json(f"{server.base}/v2/models/{model}/stats")
        assert code == 200, doc
        if check(doc["model_stats"][0]):
            return
        assert time.monotonic() < deadline, doc
        time.sleep(0.02)


def _wait_gone(pid: int, timeout: float = 30) -> None:
    import psutil

    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"process {pid} outlived the server"
        time.sleep(0.02)
