"""The benchmark's models: built from seeded weights, saved as TorchScript, cached.

- ``tiny``: y = x + 1 on 16 floats. The model costs next to nothing, so a
  server's own per-request overhead is what gets measured.
- ``mlp``: 64 floats in and out through four 4096-wide Linear+ReLU layers and
  a Linear back to 64 (about 50.6M weights, 200 MB). Batch 1 is bound by
  reading the weights, so batching pays; this is the model-bound case.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1.0


def _mlp(width: int = 4096, depth: int = 4, features: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)  # the default init, made reproducible
    layers: list[torch.nn.Module] = []
    fan_in = features
    for _ in range(depth):
        layers += [torch.nn.Linear(fan_in, width), torch.nn.ReLU()]
        fan_in = width
    layers.append(torch.nn.Linear(fan_in, features))
    return torch.nn.Sequential(*layers)


@dataclass(frozen=True)
class BenchModel:
    name: str
    features: int  # FP32 values in and out per item
    build: Callable[[], torch.nn.Module]
    description: str


MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel("tiny", 16, AddOne, "y = x + 1 on 16 floats (TorchScript)"),
    "mlp": BenchModel(
        "mlp",
        64,
        _mlp,
        "64 -> 4x[Linear 4096 + ReLU] -> Linear 64, seeded (TorchScript, ~200 MB)",
    ),
}


def default_cache_dir() -> Path:
    root = os.environ.get("ASERVE_BENCH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "aserve" / "bench"


def model_file(model: BenchModel, cache: Path) -> Path:
    """The model's TorchScript file in ``cache``, built on first use."""
    path = cache / f"{model.name}-torch{torch.__version__.split('+')[0]}.pt"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        scripted = torch.jit.script(model.build().eval())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # rename: never half a file
        scripted.save(str(tmp))
    tmp.replace(path)
    return path


def sample_input(model: BenchModel) -> list[float]:
    """The fixed request input: seeded, so every server gets the same bytes."""
    gen = torch.Generator().manual_seed(1234)
    return [round(v, 4) for v in torch.randn(model.features, generator=gen).tolist()]


def expected_output(path: Path, values: list[float]) -> list[float]:
    """What the model file itself answers for ``values`` (one item)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(path), map_location="cpu").eval()
    with torch.inference_mode():
        out: list[float] = module(torch.tensor([values], dtype=torch.float32))[0].tolist()
    return out
