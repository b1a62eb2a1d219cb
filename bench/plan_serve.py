"""``aserve serve`` on a TensorRT ``.plan``: the tensors come from the engine (GPU check step).

Takes the first engine the GPU check's TensorRT rows built (the fp32 one, in
``$ASERVE_CACHE_DIR/tensorrt``), copies it as ``mlp.plan`` and checks that

1. ``aserve serve mlp.plan --print-config`` lists the engine's own tensors
   (``INPUT0``/``OUTPUT0``, FP32, the MLP's width), given no ``--input``/``--output``;
2. ``aserve serve mlp.plan --port 0 --no-grpc`` answers an infer request with
   what the TorchScript MLP computes on the CPU.

    python -m bench.plan_serve --out result.json

Exit status 0 when both hold or the step had to be skipped (no TensorRT or no
engine built: the result says why), 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench.models import MODELS, default_cache_dir, expected_output, model_file, sample_input
from bench.servers import ServerProcess

REPO = Path(__file__).resolve().parent.parent


def check(work: Path) -> dict[str, Any]:
    from aserve.engines import tensorrt_build
    from aserve.engines.requirements import engine_problem

    problem = engine_problem("tensorrt", "cuda:0")
    if problem is not None:
        return {"result": "skipped", "why": problem}
    engines = sorted(
        tensorrt_build.cache_dir().glob("mlp-*.engine"), key=lambda p: p.stat().st_mtime
    )
    if not engines:
        return {"result": "skipped", "why": f"no engine built in {tensorrt_build.cache_dir()}"}
    plan = work / "mlp.plan"
    shutil.copy(engines[0], plan)
    mlp = MODELS["mlp"]
    argv = [sys.executable, "-m", "aserve", "serve", str(plan), "--device", "cuda:0"]
    done = subprocess.run(
        [*argv, "--print-config"], capture_output=True, text=True, timeout=180, cwd=REPO
    )
    out: dict[str, Any] = {"plan": engines[0].name, "print_config_rc": done.returncode}
    if done.returncode != 0:
        return {**out, "result": "failed", "why": done.stderr[-2000:]}
    model = json.loads(done.stdout)["models"][0]
    out["inputs"], out["outputs"] = model["inputs"], model["outputs"]
    want_io = (
        [{"name": "INPUT0", "datatype": "FP32", "shape": [mlp.features]}],
        [{"name": "OUTPUT0", "datatype": "FP32", "shape": [mlp.features]}],
    )
    if (model["inputs"], model["outputs"]) != want_io:
        return {**out, "result": "failed", "why": f"tensors read: expected {want_io}"}
    values = sample_input(mlp)
    expected = expected_output(model_file(mlp, default_cache_dir()), values)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32",
                        "data": values}]}  # fmt: skip
    with ServerProcess("aserve serve .plan", [*argv, "--port", "0", "--no-grpc"], REPO) as srv:
        req = urllib.request.Request(
            f"{srv.base_url}/v2/models/mlp/infer", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["outputs"][0]["data"]
    # fp32 engines may run TF32 kernels: a loose tolerance, scaled to the output.
    scale = max(abs(v) for v in expected) or 1.0
    err = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    out["max_abs_err"], out["scale"] = err, scale
    ok = err <= 1e-2 * scale
    return {**out, "result": "ok" if ok else "failed", "why": "" if ok else "outputs differ"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="the result, as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="aserve-plan-") as work:
        try:
            result = check(Path(work))
        except Exception as exc:  # the step reports, the script goes on
            result = {"result": "failed", "why": f"{type(exc).__name__}: {exc}"[:2000]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if result["result"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
