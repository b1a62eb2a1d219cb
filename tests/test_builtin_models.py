"""Builtin models built by several builders at once: threads of one server
(each model loads on a thread of its own) and servers sharing a cache directory.

The builders are released together by a barrier, and every builder that gets
as far as writing the file waits there until the others have written theirs
too (or a few seconds passed: with a lock, they never get there), so that the
writes all land before any rename, the interleaving that lost files before.
The server test is the same race as users met it, left to chance.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import spec, start_server, write_config
from helpers import resolve_in_threads

from aserve.engines import builtin as builtin_models

BUILDERS = 4
WRITE_GATE_S = 3.0  # how long a writer waits for the others before it renames anyway


def test_threads_building_one_builtin_model_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path))
    # Every write waits for the other builders' writes: the widest window there is
    # between a builder writing its file and renaming it into place.
    written = threading.Barrier(BUILDERS, timeout=WRITE_GATE_S)
    save = torch.jit.RecursiveScriptModule.save

    def save_then_wait(self: Any, f: Any, **kwargs: Any) -> None:
        save(self, f, **kwargs)
        try:
            written.wait()
        except threading.BrokenBarrierError:
            pass  # the others wait for the lock, not here: go on

    monkeypatch.setattr(torch.jit.RecursiveScriptModule, "save", save_then_wait)
    results = resolve_in_threads("affine", BUILDERS)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {BUILDERS} builders failed: {errors!r}"
    assert len(set(results)) == 1
    model = torch.jit.load(str(results[0]))
    assert model(torch.zeros(1, 16)).shape == (1, 16)
    assert not list(results[0].parent.glob("*.tmp")), "a builder left its file behind"


def _build_in_process(barrier: Any, cache: str, out: Any) -> None:
    os.environ["ASERVE_CACHE_DIR"] = cache
    barrier.wait()
    try:
        out.put(str(builtin_models.resolve("affine")))
    except Exception as exc:
        out.put(f"error: {exc!r}")


def test_processes_sharing_a_cache_dir_build_at_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(BUILDERS, timeout=60)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_build_in_process, args=(barrier, str(tmp_path), out))
        for _ in range(BUILDERS)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(not r.startswith("error") for r in results), results
    assert len(set(results)) == 1
    path = Path(results[0])
    assert torch.jit.load(str(path))(torch.zeros(2, 16)).shape == (2, 16)
    assert not list(path.parent.glob("*.tmp")), "a builder left its file behind"


def test_a_server_with_two_builtin_models_starts_on_an_empty_cache(tmp_path: Path) -> None:
    """The models of one server load at once, each building the same file."""
    affine = {
        "path": "builtin:affine",
        "inputs": [spec("INPUT0", "FP32", [16])],
        "outputs": [spec("OUTPUT0", "FP32", [16])],
    }
    models = [{"name": name, "engine": "torch", **affine} for name in ("a", "b", "c")]
    cache = tmp_path / "cache"
    srv = start_server(
        write_config(tmp_path, {"models": models}), extra_env={"ASERVE_CACHE_DIR": str(cache)}
    )
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
                            "data": [0.0] * 16}]}  # fmt: skip
        answers = set()
        for name in ("a", "b", "c"):
            req = urllib.request.Request(
                f"{srv.base}/v2/models/{name}/infer", data=json.dumps(body).encode()
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                answers.add(tuple(json.loads(r.read())["outputs"][0]["data"]))
        assert len(answers) == 1  # one file, the same weights for all
    finally:
        srv.stop()
