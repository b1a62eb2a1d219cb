"""Models the project builds itself, deterministically, so nothing is downloaded.

A config names one with ``"path": "builtin:NAME"``. The first start builds it
from seeded weights into the cache directory (``$ASERVE_CACHE_DIR``, else
``~/.cache/aserve``); later starts reuse it. ``affine`` is one TorchScript
file; ``tiny-gpt2`` a decoder model folder (weights, tokenizer, chat template).

Several builders may want the same file at once: the models of one server
load on threads of their own, and replicas may share a cache directory. One
builds it while the others wait for it (a lock file, flocked), each writes
under a name no other builder uses and renames into place, so a reader never
sees half a file (a folder is built under a temporary name and renamed
whole); and scripting itself is one thread at a time, because two
threads scripting one class race inside TorchScript ("Can't redefine method").

Layer ``engines``: the builders import torch (and the decoder engine) only
when they build, so that checking a config (:mod:`aserve.engines.checks`
reads :data:`BUILDERS`) does not import torch. The ``builtin:`` prefix and the
cache folder are the config layer's (:mod:`aserve.config.paths`). Blocking:
``locate`` and ``resolve`` run off the loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aserve.config.paths import PREFIX, cache_dir

# The builders import torch where they build: heavy, and not needed to check a config.


def affine() -> Any:
    """y = x @ W.T + b on 16 floats, with weights from seed 0."""
    import torch

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 16, generator=gen) * 0.25)
        layer.bias.copy_(torch.randn(16, generator=gen))
    return layer.eval()


def _write_affine(path: Path) -> None:
    import torch

    with _SCRIPTING, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        scripted = torch.jit.script(affine())
    scripted.save(str(path))


def _write_tiny_gpt2(folder: Path) -> None:
    from aserve.engines.decoder.tiny import build_tiny_gpt2

    build_tiny_gpt2(folder)


def _torch_version() -> str:
    import torch

    return "torch" + torch.__version__.split("+")[0]


def _torch_tokenizers_versions() -> str:
    import tokenizers

    return f"{_torch_version()}-tokenizers{tokenizers.__version__}"


@dataclass(frozen=True)
class Builtin:
    """How to build one builtin model, and what its cached copy depends on."""

    write: Callable[[Path], None]  # writes the model at this path (a folder: made empty)
    engine: str  # the engine that serves it
    folder: bool  # a model folder rather than one file
    suffix: str  # of the file name
    revision: int  # bump when the builder changes its weights, tokenizer or architecture
    versions: Callable[[], str]  # the libraries whose versions the built bytes depend on


BUILDERS: dict[str, Builtin] = {
    "affine": Builtin(_write_affine, "torch", False, ".pt", 1, _torch_version),
    "tiny-gpt2": Builtin(_write_tiny_gpt2, "decoder", True, "", 1, _torch_tokenizers_versions),
}

_SCRIPTING = threading.Lock()  # torch.jit.script is not safe to run on two threads at once


def locate(path: str, base_dir: Path) -> Path:
    """Where a config's model ``path`` is: a builtin model (built on first use),
    else a path relative to the config's folder. Blocking: call off the loop."""
    if path.startswith(PREFIX):
        return resolve(path[len(PREFIX) :])
    return (base_dir / path).resolve()


def resolve(name: str) -> Path:
    """The file (or folder) of builtin model ``name``, built on first use. Blocking."""
    builtin = BUILDERS.get(name)
    if builtin is None:
        raise FileNotFoundError(
            f"unknown builtin model '{name}' (builtin models: {', '.join(sorted(BUILDERS))})"
        )
    # The name carries the builder's revision and the libraries' versions, so a
    # changed builder or an upgraded library never reuses a stale copy.
    stem = f"{name}-r{builtin.revision}-{builtin.versions()}"
    path = cache_dir() / "builtin" / (stem + builtin.suffix)
    if path.exists():  # only complete copies are ever renamed into place
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.with_name(path.name + ".lock")):
        if path.exists():  # built by whoever held the lock before
            return path
        # Written beside under a name of its own (pid + random), then renamed:
        # atomic (a folder too, onto a name that does not exist), so a
        # concurrent start never reads half a model.
        prefix = f"{path.name}.{os.getpid()}."
        if builtin.folder:
            tmp = tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent)
            os.chmod(tmp, 0o755)  # as a plain mkdir would (mkdtemp's is 0700)
        else:
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
            os.fchmod(fd, 0o644)  # as a plain open would (mkstemp's is 0600)
            os.close(fd)
        try:
            builtin.write(Path(tmp))
            if builtin.folder:  # readable by other users of a shared cache, as the file is
                for member in Path(tmp).iterdir():
                    os.chmod(member, 0o644)
            os.replace(tmp, path)
        finally:
            # Only left if building failed.
            if builtin.folder:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
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
