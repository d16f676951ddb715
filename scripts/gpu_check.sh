#!/usr/bin/env bash
# The prepared GPU check: GPU tests, then the GPU benchmark; under 8 minutes on one H200.
#
#   scripts/gpu_check.sh --fetch-wheels   on a machine with network: download the wheels the GPU machine lacks
#                                         (flash-linear-attention for python 3.12) into .whl/ (git-ignored)
#   scripts/gpu_check.sh                  on the GPU machine, from the repository root, no network needed:
#                                         installs .whl/ into a scratch folder, runs everything from the source tree
#                                         (PYTHONPATH, no install of the project), writes into $OUT
#                                         (default runs/gpu_check): environment.txt, gpu_tests.log, gpu_tests.xml,
#                                         gpu_bench.log, gpu_bench.json, gpu_bench.md
# Exit status: 0 when the tests and the benchmark both succeeded; 1 otherwise (the logs say which). Without a GPU the
# tests skip (the kernel tests run under Triton's interpreter) and the benchmark is not run.
# With the device tool: carry [".whl"], command "bash scripts/gpu_check.sh", timeout_s 560.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(flash-linear-attention==0.6.0 fla-core==0.6.0)  # fla's kernels; einops, triton, torch are on the machine

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
fi

OUT=${OUT:-$PWD/runs/gpu_check}
mkdir -p "$OUT"
SITE=${TMPDIR:-/tmp}/hypic-rag-gpu-site
WHEEL_DIR=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL_DIR"/*.whl \
        || { echo "gpu_check: cannot install the wheels in $WHEEL_DIR/" >&2; exit 1; }
else
    echo "gpu_check: no wheels in $WHEEL_DIR/ (run scripts/gpu_check.sh --fetch-wheels where there is network): fla tests skip" >&2
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET HYPIC_RAG_KERNELS

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PY" - <<'PYTHON' 2>&1
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.cuda.is_available())
for name in ("triton", "transformers", "fla", "hypic_rag", "hypic_rag.kernels"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", ""), module.__file__)
    except Exception as error:
        print(name, "NOT IMPORTABLE:", type(error).__name__, error)
from hypic_rag.kernels import triton_enabled
from hypic_rag.kernels.gated_delta_rule import fla_available
print("triton kernels on cuda:", triton_enabled(torch.zeros(1, device="cuda")) if torch.cuda.is_available() else False,
      "| fla available:", fla_available())
PYTHON
} | tee "$OUT/environment.txt"

echo "== GPU tests" | tee "$OUT/gpu_tests.log"
timeout 210 "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml "$OUT/gpu_tests.xml" \
    tests/runtime/test_gpu_path.py tests/ops/test_kernels_gpu.py tests/kernels 2>&1 | tee -a "$OUT/gpu_tests.log"
tests_status=${PIPESTATUS[0]}

echo "== GPU benchmark" | tee "$OUT/gpu_bench.log"
# GPU_CHECK_BENCH_ARGS: extra arguments (e.g. "--shape tiny --device cpu --dtype float32" for a smoke run without a GPU)
if [ -z "${GPU_CHECK_BENCH_ARGS:-}" ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: no CUDA device: benchmark not run" | tee -a "$OUT/gpu_bench.log"
    bench_status=1
else
    # shellcheck disable=SC2086
    timeout 240 "$PY" -m hypic_rag.bench.gpu --output "$OUT" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/gpu_bench.log"
    bench_status=${PIPESTATUS[0]}
fi

echo "gpu_check: tests exit $tests_status, benchmark exit $bench_status (124: timed out); results in $OUT"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
