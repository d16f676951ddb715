#!/usr/bin/env bash
# The prepared GPU check for every mixer kind: GPU tests, then the GPU benchmark; about 8 minutes on one H200.
#
#   scripts/gpu_check.sh --fetch-wheels   where there is network: download the wheels the GPU machine lacks into .whl/
#                                         (git-ignored): flash-linear-attention + fla-core 0.6.0 (fla's kernels),
#                                         transformers 5.24.0 (the machine has 5.17; the CPU tests passed on 5.24
#                                         and now run 5.25, which would also need the `kernels` distribution and a
#                                         newer huggingface-hub than the machine may have) and regex (transformers
#                                         5.24 checks its version at import); ~16 MB
#   scripts/gpu_check.sh                  on the GPU machine, from the repository root, no network needed: installs
#                                         .whl/ into a scratch folder, runs everything from the source tree
#                                         (PYTHONPATH, no install of the project), writes into $OUT (default
#                                         runs/gpu_check): environment.txt, gpu_tests.log, gpu_tests.xml,
#                                         kernel_tests.xml, gpu_bench.log, gpu_bench.json, gpu_bench.md
# Exit status: 0 when the tests and the benchmark all succeeded; 1 otherwise (the logs say which). Without a GPU the
# GPU tests skip and the benchmark is not run (GPU_CHECK_BENCH_ARGS="--size tiny --device cpu --dtype float32"
# runs it anyway, as a smoke run).
# Time: GPU_CHECK_SECONDS (default 470) bounds the whole script; the tests get at most 200 s, the benchmark what
# is left (its own --budget-seconds, minus a margin for the measurement in flight). Every stage is stopped with
# SIGINT first, so pytest still writes its XML and the benchmark has written its JSON after every measurement.
# With the device tool: carry [".whl"], command "bash scripts/gpu_check.sh", timeout_s 560.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(flash-linear-attention==0.6.0 fla-core==0.6.0 transformers==5.24.0 regex==2026.11.19)
# einops, triton 3.6, torch 2.11, huggingface-hub, tokenizers, safetensors are on the machine (KINDS.md)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
fi

started=$SECONDS
TOTAL=${GPU_CHECK_SECONDS:-470}
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
export HYPIC_RAG_FLA_AUTOTUNE_CONFIGS=${HYPIC_RAG_FLA_AUTOTUNE_CONFIGS:-2}  # fla's autotuning in seconds, not minutes
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # six models one after another
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
from hypic_rag.runtime.ops import backends
cuda = torch.cuda.is_available()
print("triton kernels on cuda:", backends.use_triton(torch.zeros(1, device="cuda")) if cuda else False,
      "| fla ready:", {op: backends.fla_ready(op) for op in backends.FLA_OPS})
PYTHON
} | tee "$OUT/environment.txt"

left() { echo $(( TOTAL - (SECONDS - started) )); }

echo "== GPU tests" | tee "$OUT/gpu_tests.log"
TEST_SECONDS=$(( $(left) < 200 ? $(left) : 200 ))
timeout -s INT -k 15 $(( TEST_SECONDS * 3 / 4 )) "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml "$OUT/gpu_tests.xml" \
    tests/ops/test_kernels_gpu.py tests/runtime/test_gpu_path.py 2>&1 | tee -a "$OUT/gpu_tests.log"
tests_status=${PIPESTATUS[0]}
echo "== Triton kernel tests on the GPU" | tee -a "$OUT/gpu_tests.log"
timeout -s INT -k 10 $(( TEST_SECONDS / 4 )) "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml "$OUT/kernel_tests.xml" \
    tests/kernels 2>&1 | tee -a "$OUT/gpu_tests.log"
kernel_status=${PIPESTATUS[0]}

echo "== GPU benchmark" | tee "$OUT/gpu_bench.log"
# GPU_CHECK_BENCH_ARGS: extra arguments (e.g. "--size tiny --device cpu --dtype float32" for a smoke run without a GPU)
if [ -z "${GPU_CHECK_BENCH_ARGS:-}" ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: no CUDA device: benchmark not run" | tee -a "$OUT/gpu_bench.log"
    bench_status=1
else
    BUDGET=$(( $(left) - 50 ))  # the margin: a measurement that started just before the budget ran out
    if [ "$BUDGET" -lt 30 ]; then BUDGET=30; fi
    # shellcheck disable=SC2086
    timeout -s INT -k 15 $(( BUDGET + 45 )) "$PY" -m hypic_rag.bench.gpu --output "$OUT" --budget-seconds "$BUDGET" \
        ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee -a "$OUT/gpu_bench.log"
    bench_status=${PIPESTATUS[0]}
fi

echo "gpu_check: GPU tests exit $tests_status, kernel tests exit $kernel_status, benchmark exit $bench_status" \
     "(124 / 130: stopped at its time limit) after $(( SECONDS - started )) s; results in $OUT"
[ "$tests_status" -eq 0 ] && [ "$kernel_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
