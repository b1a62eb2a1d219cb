"""The wire types, codecs, streaming channel and config import without torch.

Each case runs a fresh interpreter whose meta-path finder refuses ``torch``,
``onnxruntime`` and ``tensorrt`` (as on a machine with none of them), imports
one module, and reports what else it pulled in. A module that reaches for an
engine fails here with the import chain in the message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_PROBE = r"""
import importlib, importlib.abc, sys, traceback

BLOCKED = ("torch", "onnxruntime", "tensorrt")

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked: this Python has no {name}")
        return None

sys.meta_path.insert(0, Refuse())
last = None
for name in sys.argv[1].split(","):  # the first name that imports wins (a module may move)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            last = f"no module {name}"
            continue
        traceback.print_exc()
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print(name)
    sys.exit(0)
print(last, file=sys.stderr)
sys.exit(2)
"""

# Modules of the types, codecs, streaming-channel and config layers.
LAYERS = [
    "aserve.types",
    "aserve.types.tensors",
    "aserve.types.generation",
    "aserve.codecs",
    "aserve.codecs.binary",
    "aserve.codecs.validate",
    "aserve.codecs.v2",
    "aserve.codecs.v2_grpc",
    "aserve.codecs.sampling",
    "aserve.loop.channel",
    "aserve.config",
    "aserve.config.schema",
    "aserve.config.load",
    "aserve.config.pipelines",
    "aserve.config.paths",
]

# The generation frontends: what they import of the runtime, the batcher and
# the step executors must not pull the decoder engine (torch) in with it.
FRONTENDS = [
    "aserve.frontends.http.openai",
    "aserve.frontends.http.embeddings",
    "aserve.frontends.http.generate",
    "aserve.frontends.grpc.generate",
    # A frontend process of http.workers: spawned fresh, it must not load torch.
    "aserve.frontends.proc.main",
]


def _import_without_torch(names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, names],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("module", LAYERS)
def test_imports_without_torch(module: str) -> None:
    run = _import_without_torch(module)
    assert run.returncode == 0, f"{module} needs torch:\n{run.stderr[-3000:]}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("names", FRONTENDS)
def test_generation_frontends_import_without_torch(names: str) -> None:
    run = _import_without_torch(names)
    assert run.returncode == 0, f"{names} needs torch:\n{run.stderr[-3000:]}"


@pytest.mark.timeout(90)
def test_the_blocker_blocks() -> None:
    """The finder is what stops torch: the decoder engine must fail under it."""
    run = _import_without_torch("aserve.engines.decoder")
    assert run.returncode == 1 and "torch is blocked" in run.stderr


@pytest.mark.timeout(90)
def test_config_stays_below_the_engines() -> None:
    """Loading a config (schema, archives, pipelines) imports no engine, loop or
    frontend module; only :mod:`aserve.engines.checks` may."""
    code = (
        "import sys, aserve.config as c\n"
        "c.parse_config({'models': [{'name': 'm', 'engine': 'pipeline', 'steps': [{'model': 'a'}],"
        " 'inputs': [{'name': 'X', 'datatype': 'FP32', 'shape': [1]}],"
        " 'outputs': [{'name': 'X', 'datatype': 'FP32', 'shape': [1]}]},"
        " {'name': 'a', 'engine': 'torch', 'path': 'a.pt',"
        " 'inputs': [{'name': 'X', 'datatype': 'FP32', 'shape': [1]}],"
        " 'outputs': [{'name': 'Y', 'datatype': 'FP32', 'shape': [1]}]}]}, base_dir=None)\n"
        "up = ('engines', 'loop', 'frontends', 'scheduler', 'streaming', 'codecs')\n"
        "bad = sorted(m for m in sys.modules if m.startswith('aserve.') and"
        " (m.split('.')[1] in up or m == 'aserve.engines.checks'))\n"
        "assert not bad, bad\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-3000:]
