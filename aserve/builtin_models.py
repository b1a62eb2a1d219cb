"""Models the project builds itself, deterministically, so nothing is downloaded.

A config names one with ``"path": "builtin:NAME"``. The first start builds it
from seeded weights into the cache directory (``$ASERVE_CACHE_DIR``, else
``~/.cache/aserve``); later starts reuse the file.

Several builders may want the same file at once: the models of one server
load on threads of their own, and replicas may share a cache directory. One
builds it while the others wait for it (a lock file, flocked), each writes
under a name no other builder uses and renames into place, so a reader never
sees half a file; and scripting itself is one thread at a time, because two
threads scripting one class race inside TorchScript ("Can't redefine method").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
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

_SCRIPTING = threading.Lock()  # torch.jit.script is not safe to run on two threads at once


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
    with _exclusive(path.with_name(path.name + ".lock")):
        if path.is_file():  # built by whoever held the lock before
            return path
        with _SCRIPTING, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            scripted = torch.jit.script(builder())
        # Written beside under a name of its own (pid + random), then renamed:
        # atomic, so a concurrent start never reads half a file.
        fd, tmp = tempfile.mkstemp(
            prefix=f"{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent
        )
        os.fchmod(fd, 0o644)  # as a plain open would (mkstemp's is 0600)
        os.close(fd)
        try:
            scripted.save(tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # only left if saving failed
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (blocking). Each call opens its own
    descriptor, so this excludes other threads of this process as well as other
    processes; the kernel drops the lock if the holder dies."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
