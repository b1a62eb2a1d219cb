#!/usr/bin/env bash
# One prepared GPU check for aserve: detect the GPU, run the GPU-marked tests, measure the
# bench MLP through aserve on cuda:0 (torch with 1/2/4 instances and CUDA graphs, onnxruntime's
# CUDA provider, TensorRT fp32/fp16), serve a built engine as a .plan with `aserve serve`
# (tensors read from the engine), run the many-models benches on cuda:0 (a shared device against
# independent instances, priority levels), and write a Markdown report.
#
#   bench/gpu_check.sh                  # run the check (about 8-11 minutes on a GPU)
#   bench/gpu_check.sh --fetch-wheels   # here, with PyPI: wheels for a GPU box without them
#
# Without a GPU it runs what it can (the tests' CPU-side skips, CPU smoke rows of the harness),
# prints what it skipped and why, and writes the report outside bench/results/.
#
# Environment:
#   PYTHON          the interpreter (default: the first of .venv/bin/python, python3 whose torch
#                   sees CUDA; else the first that imports torch)
#   GPU_CHECK_OUT   where the report goes (default: bench/results on a GPU, else
#                   /tmp/aserve-gpu-check)
#   ASERVE_WHEELS   folder of wheels installed into a private site folder first when aserve's
#                   dependencies do not import (default: .whl; see --fetch-wheels)
#   DURATION, CONCURRENCY   per-row measured seconds (5) and connections (64)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STAMP=$(date -u +%Y%m%d-%H%M)
WHEELS=${ASERVE_WHEELS:-.whl}
# What aserve and its tests need beyond a CUDA machine's usual image (torch, numpy, aiohttp, ...).
WHEEL_PKGS="pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson
 msgpack grpcio grpcio-health-checking grpcio-reflection protobuf tokenizers safetensors jinja2
 pytest-asyncio pytest-timeout tritonclient python-rapidjson geventhttpclient gevent greenlet
 zope.event zope.interface brotli urllib3 certifi onnxconverter-common"

say() { printf '\n== %s\n' "$*"; }

if [ "${1:-}" = "--fetch-wheels" ]; then
  # Versions as installed here, so the GPU box runs what the tests ran with.
  PY=${PYTHON:-.venv/bin/python}
  mkdir -p "$WHEELS"
  for pkg in $WHEEL_PKGS; do
    ver=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg" 2>/dev/null) \
      || { echo "skip $pkg: not installed here"; continue; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d "$WHEELS" "$pkg==$ver" || echo "could not fetch $pkg==$ver"
  done
  du -sh "$WHEELS"
  echo "carry $WHEELS with the tree; keep it out of git, e.g. echo /.whl/ >> .git/info/exclude"
  exit 0
fi

pick_python() {
  local candidates=("${PYTHON:-}" .venv/bin/python python3) p
  for p in "${candidates[@]}"; do
    [ -n "$p" ] || continue
    if "$p" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      echo "$p"; return
    fi
  done
  for p in "${candidates[@]}"; do
    [ -n "$p" ] || continue
    if "$p" -c "import torch" 2>/dev/null; then echo "$p"; return; fi
  done
}
PY=$(pick_python)
if [ -z "$PY" ]; then echo "gpu_check: no Python with torch found (set PYTHON)" >&2; exit 2; fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pydantic, orjson, grpc_health, tritonclient.http, pytest_asyncio" 2>/dev/null; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    say "installing carried wheels from $WHEELS into /tmp/aserve-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/aserve-site "$WHEELS"/*.whl || echo "gpu_check: wheel install failed"
    export PYTHONPATH="/tmp/aserve-site:$PYTHONPATH"
  else
    echo "gpu_check: aserve's dependencies do not import with $PY and there are no wheels in" \
         "$WHEELS (run bench/gpu_check.sh --fetch-wheels where PyPI is reachable)" >&2
  fi
fi

MODE=$("$PY" -c "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')")
OUTDIR=${GPU_CHECK_OUT:-$([ "$MODE" = gpu ] && echo bench/results || echo /tmp/aserve-gpu-check)}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/aserve-gpu-check.XXXXXX)
export ASERVE_BENCH_CACHE=${ASERVE_BENCH_CACHE:-$WORK/cache}
export ASERVE_CACHE_DIR=${ASERVE_CACHE_DIR:-$WORK/cache/aserve}
export PYTHONUNBUFFERED=1

say "machine ($MODE mode, python: $PY)"
{
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" - <<'EOF'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""))
try:
    import onnxruntime as ort
    print(f"onnxruntime {ort.__version__}: {', '.join(ort.get_available_providers())}")
except ImportError:
    print("onnxruntime: not installed")
try:
    import tensorrt
    print(f"tensorrt {tensorrt.__version__}")
except ImportError:
    print("tensorrt: not installed")
print("cuda-python:", "installed" if importlib.util.find_spec("cuda") else "not installed")
EOF
  echo "cores: $(nproc)"
} 2>&1 | tee "$WORK/facts.txt"

say "GPU-marked tests (pytest -m gpu)"
timeout 240 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/ 2>&1 | tee "$WORK/tests.log"
TESTS_RC=${PIPESTATUS[0]}
echo "pytest exit status: $TESTS_RC"

say "aserve.Batched: worker processes spread over the CUDA devices"
# Also among the GPU-marked tests above; run on its own so that the report says it ran.
timeout 120 "$PY" -m pytest -q -rs -p no:cacheprovider \
  "tests/test_batched.py::test_workers_spread_over_cuda_devices" 2>&1 | tee "$WORK/batched.log"
echo "Batched CUDA spread: pytest exit status ${PIPESTATUS[0]}"

say "throughput: the bench MLP through aserve"
timeout 420 "$PY" -m bench.gpu_bench --out "$WORK/gpu_bench.json" \
  --duration "${DURATION:-5}" --concurrency "${CONCURRENCY:-64}" \
  --md "$OUTDIR/gpu-$STAMP$([ "$MODE" = gpu ] || echo -cpu-only).md" \
  --tests-log "$WORK/tests.log" --facts "$WORK/facts.txt"
BENCH_RC=$?
REPORT="$OUTDIR/gpu-$STAMP$([ "$MODE" = gpu ] || echo -cpu-only).md"
cp "$WORK/gpu_bench.json" "${REPORT%.md}.json" 2>/dev/null

say "aserve serve on a TensorRT .plan (tensors read from the engine the rows above built)"
timeout 300 "$PY" -m bench.plan_serve --out "$WORK/plan_serve.json"
PLAN_RC=$?
if [ -f "$REPORT" ] && [ -f "$WORK/plan_serve.json" ]; then
  { echo; echo "## aserve serve on a .plan"; echo; echo '```json'; cat "$WORK/plan_serve.json"
    echo '```'; } >> "$REPORT"
fi

say "many models on one device: shared against independent, priority levels (cuda:0)"
SHARED_RC=0
if [ "$MODE" = gpu ]; then
  timeout 420 "$PY" -m bench.shared_device --device cuda:0 --duration "${DURATION:-5}" \
    --json "$WORK/shared-device.json" 2>&1 | tee "$WORK/shared-device.md"
  SHARED_RC=${PIPESTATUS[0]}
  if [ -f "$REPORT" ]; then
    { echo; echo "## Many models on one device (bench.shared_device --device cuda:0)"; echo
      grep '^|\|^Capacity\|^In-process' "$WORK/shared-device.md"; } >> "$REPORT"
  fi
else
  echo "skipped: no CUDA device (python -m bench.shared_device runs the CPU version)"
fi

say "many models in a memory budget on cuda:0: loads on demand, eviction (cost rule)"
BUDGET_RC=0
if [ "$MODE" = gpu ]; then
  timeout 420 "$PY" -m bench.memory_budget --device cuda:0 --policy cost \
    --duration "${BUDGET_DURATION:-60}" --json "$WORK/memory-budget.json" 2>&1 \
    | tee "$WORK/memory-budget.md"
  BUDGET_RC=${PIPESTATUS[0]}
  if [ -f "$REPORT" ]; then
    { echo; echo "## Many models in a memory budget (bench.memory_budget --device cuda:0)"; echo
      grep '^|\|budget' "$WORK/memory-budget.md"; } >> "$REPORT"
  fi
else
  echo "skipped: no CUDA device (python -m bench.memory_budget runs the CPU version)"
fi

say "report: $REPORT"
if [ -f "$REPORT" ]; then cat "$REPORT"; fi
if [ "$MODE" = cpu ]; then
  say "CPU-ONLY MODE: no CUDA device was found, so these did NOT run"
  echo "- GPU tests: torch on cuda:0 with 2 instances (with and without CUDA graphs),"
  echo "  concurrent batches on two streams, onnxruntime's CUDA provider, TensorRT build/serve/cache,"
  echo "  aserve.Batched workers spread over the CUDA devices"
  echo "  (each skipped above with its reason)"
  echo "- throughput rows on cuda:0: torch x1/x2/x4, CUDA graphs, onnx CUDA provider, TensorRT"
  echo "  (see 'Skipped' in the report; the CPU smoke rows only show the harness works)"
  echo "- aserve serve on a TensorRT .plan reading its tensors from the engine"
  echo "- many models on one device (bench.shared_device --device cuda:0)"
  echo "- many models in a memory budget (bench.memory_budget --device cuda:0)"
fi
echo "gpu_check: tests exit $TESTS_RC, bench exit $BENCH_RC, plan serve exit $PLAN_RC," \
  "shared device exit $SHARED_RC, memory budget exit $BUDGET_RC"
[ "$TESTS_RC" -eq 0 ] || [ "$TESTS_RC" -eq 5 ] || exit 1
[ "$PLAN_RC" -eq 0 ] || exit 1
[ "$SHARED_RC" -eq 0 ] || exit 1
[ "$BUDGET_RC" -eq 0 ] || exit 1
exit "$BENCH_RC"
