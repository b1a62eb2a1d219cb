"""What the server says of its models: ``GET /v2/models``, every routed version in
a model's metadata (HTTP and gRPC), and a ``.pt2`` program's own platform."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import ServerProcess, model_entry, spec, start_server, write_config


@pytest.fixture(scope="module")
def two_versions(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("listing")
    affine = [spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])]
    pair = (
        [spec("A", "FP32", [8]), spec("B", "FP32", [8])],
        [spec("SUM", "FP32", [8]), spec("DOT", "FP32", [1])],
    )
    config = {
        "grpc": {"port": 0},
        "models": [
            model_entry("affine", str(model_dir / "affine.pt"), *affine, version="1"),
            model_entry("affine", str(model_dir / "affine.pt"), *affine, version="3"),
            model_entry("pair", str(model_dir / "pair.pt2"), *pair),
        ],
    }
    srv = start_server(write_config(folder, config))
    yield srv
    srv.stop()


async def test_get_models_lists_every_routed_version(two_versions: ServerProcess) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{two_versions.base}/v2/models") as r:
            assert r.status == 200
            doc = await r.json()
    assert doc == {
        "models": [
            {"name": "affine", "version": "1", "state": "READY", "platform": "pytorch_torchscript"},
            {"name": "affine", "version": "3", "state": "READY", "platform": "pytorch_torchscript"},
            {"name": "pair", "version": "1", "state": "READY", "platform": "pytorch_export"},
        ]
    }


async def test_metadata_names_every_version_whichever_is_asked(two_versions: ServerProcess) -> None:
    async with aiohttp.ClientSession() as session:
        for path in ("/v2/models/affine", "/v2/models/affine/versions/1"):
            async with session.get(two_versions.base + path) as r:
                assert r.status == 200
                assert (await r.json())["versions"] == ["1", "3"], path
        async with session.get(f"{two_versions.base}/v2/models/affine/config") as r:
            assert (await r.json())["platform"] == "pytorch_torchscript"
        async with session.get(f"{two_versions.base}/v2/models/pair/config") as r:
            assert (await r.json())["platform"] == "pytorch_export"


def test_grpc_metadata_names_every_version(two_versions: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(two_versions.grpc_url)
    try:
        for version in ("", "3"):
            meta = client.get_model_metadata("affine", version, as_json=True)
            assert meta["versions"] == ["1", "3"]
        assert client.get_model_metadata("pair", as_json=True)["platform"] == "pytorch_export"
    finally:
        client.close()
