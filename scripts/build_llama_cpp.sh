#!/usr/bin/env bash
# The peer of the peers benchmark (docs/benchmarks/peers.md), from one command: llama.cpp from llama-cpp-python's
# source distribution, built with the same AVX-512 flags everywhere (native detection off, no AMX: see peers.md),
#   1. llama-cpp-python (the Python bindings) into the project's venv (`pip install -e '.[peers]'`),
#   2. llama-server from the same source (its own build tree under DIR),
#   3. the GGUF files (F32, Q8_0) of the benchmark's models, by llama.cpp's own converter,
# each step timed. A step already done is skipped (bindings importable, ninja up to date). Never part of `make test`.
#
#   scripts/build_llama_cpp.sh [DIR]      (DIR: where the source, the build tree and the GGUF files go; peers_build)
#
# Then: .venv/bin/python -m hypic_rag.bench.peers --llama-cpp-source DIR/llama_cpp_python-0.3.36 \
#           --llama-server DIR/llama-server-build/bin/llama-server --json docs/benchmarks/peers.json
set -euo pipefail

VERSION=0.3.36
DIR=${1:-peers_build}
PYTHON=${PYTHON:-.venv/bin/python}
NICE=${NICE:-5}
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
SOURCE=$DIR/llama_cpp_python-$VERSION
BUILD=$DIR/llama-server-build

step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
took() { echo "== $1 took $(( $(date +%s) - $2 )) s"; }

mkdir -p "$DIR"
step "source: llama-cpp-python $VERSION (it vendors llama.cpp and its converter)"
if [ ! -f "$SOURCE/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR"
    tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi

step "1. llama-cpp-python into $PYTHON's environment"
began=$(date +%s)
if ! "$PYTHON" -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="$FLAGS" nice -n "$NICE" "$PYTHON" -m pip install -e '.[peers]'
fi
took "llama-cpp-python" "$began"

step "2. llama-server from $SOURCE/vendor/llama.cpp into $BUILD"
began=$(date +%s)
if [ ! -f "$BUILD/build.ninja" ]; then
    # shellcheck disable=SC2086
    cmake -S "$SOURCE/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
fi
nice -n "$NICE" ninja -C "$BUILD" llama-server
"$BUILD/bin/llama-server" --version
took "llama-server" "$began"

step "3. GGUF files (F32, Q8_0) of the bundled and the 174M timing model into $DIR/gguf"
began=$(date +%s)
nice -n "$NICE" "$PYTHON" -m hypic_rag.bench.peers --llama-cpp-source "$SOURCE" --convert-only "$DIR/gguf" >/dev/null
ls -l "$DIR"/gguf/*.gguf
took "conversion" "$began"
