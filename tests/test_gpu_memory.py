"""The "gpu" block: its settings, the arithmetic of the per-device cap, the
cache release, and a server that starts with it on a machine without a GPU.
(On a GPU, tests/test_gpu.py checks that the cap really refuses memory.)"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import model_entry, start_server, write_config

from aserve.config import ConfigError, GpuConfig, parse_config
from aserve.engines.gpu_memory import MIB, CacheReleaser, apply_memory_limit, cuda_indices


class RecordingCuda:
    """Stands in for ``torch.cuda`` where there is no GPU: devices of a given
    size, and a record of what was asked of the allocator."""

    def __init__(self, total_mib: int) -> None:
        self.total = total_mib * MIB
        self.fractions: dict[int, float] = {}
        self.emptied = 0

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None:
        assert 0 < fraction <= 1
        self.fractions[index] = fraction

    def empty_cache(self) -> None:
        self.emptied += 1


def test_cuda_indices_come_from_the_models_devices():
    assert cuda_indices(["cpu", "cuda", "cuda:1", "cuda:0", "cpu"]) == [0, 1]
    assert cuda_indices(["cpu"]) == []


def test_the_cap_is_the_limit_as_a_fraction_of_each_device():
    cuda = RecordingCuda(total_mib=8192)
    got = apply_memory_limit(cuda, GpuConfig(mem_limit_mib=2048), [0, 1])
    assert got == {0: 0.25, 1: 0.25}
    assert cuda.fractions == {0: 0.25, 1: 0.25}


def test_a_limit_over_the_device_leaves_it_uncapped():
    cuda = RecordingCuda(total_mib=1024)
    assert apply_memory_limit(cuda, GpuConfig(mem_limit_mib=4096), [0]) == {0: 1.0}


def test_no_limit_touches_nothing():
    cuda = RecordingCuda(total_mib=1024)
    assert apply_memory_limit(cuda, GpuConfig(), [0]) == {}
    assert cuda.fractions == {}


def test_cache_is_released_only_once_the_interval_has_passed():
    cuda = RecordingCuda(total_mib=1024)
    releaser = CacheReleaser(cuda, interval_s=3600)
    releaser.maybe()
    assert cuda.emptied == 0
    releaser.interval_s = 0.0
    releaser.maybe()
    assert cuda.emptied == 1


@pytest.mark.parametrize(
    ("block", "path"),
    [
        ({"mem_limit_mib": 0}, "gpu.mem_limit_mib"),
        ({"empty_cache_interval_s": -1}, "gpu.empty_cache_interval_s"),
        ({"mem_limit": 10}, "gpu.mem_limit"),
    ],
)
def test_bad_gpu_settings_name_the_field(block: dict, path: str):
    with pytest.raises(ConfigError) as err:
        parse_config({"gpu": block})
    assert path in str(err.value)


def test_a_server_with_gpu_settings_serves_on_a_machine_without_a_gpu(
    model_dir: Path, tmp_path: Path
):
    spec = {"name": "INPUT0", "datatype": "FP32", "shape": [16]}
    out = {**spec, "name": "OUTPUT0"}
    config = {
        "gpu": {"mem_limit_mib": 1024, "empty_cache_interval_s": 0.5},
        "models": [model_entry("affine", str(model_dir / "affine.pt"), [spec], [out])],
    }
    srv = start_server(write_config(tmp_path, config))
    try:
        with urllib.request.urlopen(srv.base + "/v2/models/affine/ready") as r:
            assert r.status == 200
        import torch

        if not torch.cuda.is_available():
            assert "gpu settings not applied: torch sees no CUDA device" in srv.log_text()
    finally:
        srv.stop()
