"""Models the project builds itself, deterministically, so nothing is downloaded.

A config names one with ``"path": "builtin:NAME"``. The first start builds it
from seeded weights into the cache directory (``$ASERVE_CACHE_DIR``, else
``~/.cache/aserve``); later starts reuse the file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "builtin:"
REVISION = 1  # bump when a builder changes its weights or architecture


def _affine() -> Any:
    """y = x @ W.T + b on 16 floats, with weights from seed 0."""
    import torch

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 16, generator=gen) * 0.25)
        layer.bias.copy_(torch.randn(16, generator=gen))
    return layer.eval()


BUILDERS: dict[str, Callable[[], Any]] = {"affine": _affine}


def cache_dir() -> Path:
    root = os.environ.get("ASERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "aserve"


def resolve(name: str) -> Path:
    """The TorchScript file of builtin model ``name``, built on first use. Blocking."""
    import torch

    builder = BUILDERS.get(name)
    if builder is None:
        raise FileNotFoundError(
            f"unknown builtin model '{name}' (builtin models: {', '.join(sorted(BUILDERS))})"
        )
    # The file name carries the builder's revision and torch's version, so a
    # changed builder or an upgraded torch never reuses a stale file.
    torch_version = torch.__version__.split("+")[0]
    path = cache_dir() / "builtin" / f"{name}-r{REVISION}-torch{torch_version}.pt"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        scripted = torch.jit.script(builder())
        # Write beside and rename, so a concurrent start never reads half a file.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        scripted.save(str(tmp))
    tmp.replace(path)
    return path
