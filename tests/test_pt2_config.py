"""A ``.pt2`` in a config needs no ``inputs``/``outputs``: the program carries them,
as an ONNX file does (in instance threads and in worker processes alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from aserve.config import ConfigError, load_config
from tests.conftest import start_server, write_config

pytestmark = pytest.mark.timeout(180)


def _pair(model_dir: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "engine": "torch", "path": str(model_dir / "pair.pt2"), **extra}


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_pt2_serves_the_tensors_its_program_declares(
    model_dir: Path, eager_models: dict[str, Any], tmp_path: Path, executor: str
) -> None:
    config = write_config(tmp_path, {"models": [_pair(model_dir, "pair", executor=executor)]})
    srv = start_server(config)
    a = np.arange(16, dtype=np.float32).reshape(2, 8)
    b = np.ones((2, 8), dtype=np.float32)
    body = {"inputs": [
        {"name": n, "datatype": "FP32", "shape": [2, 8], "data": x.ravel().tolist()}
        for n, x in (("a", a), ("b", b))
    ]}  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{srv.base}/v2/models/pair") as r:
                meta = await r.json()
            async with session.post(f"{srv.base}/v2/models/pair/infer", json=body) as r:
                assert r.status == 200, await r.text()
                out = {o["name"]: o for o in (await r.json())["outputs"]}
    finally:
        srv.stop()
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("a", "FP32", [-1, 8]), ("b", "FP32", [-1, 8]),  # forward's own argument names
    ]  # fmt: skip
    assert [t["name"] for t in meta["outputs"]] == ["SUM", "DOT"]
    with torch.no_grad():
        want = eager_models["pair"](torch.from_numpy(a), torch.from_numpy(b))
    np.testing.assert_allclose(np.array(out["SUM"]["data"]).reshape(2, 8), want["SUM"].numpy())
    np.testing.assert_allclose(np.array(out["DOT"]["data"]), want["DOT"].numpy().ravel())
    assert "tensors from the program: inputs a FP32 [8], b FP32 [8]" in srv.log_text()


def test_a_torchscript_file_still_needs_its_tensors_listed(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"models": [
        {"name": "m", "engine": "torch", "path": "m.pt"},
    ]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"list at least one tensor \(a \.pt2 program carries"):
        load_config(path)
