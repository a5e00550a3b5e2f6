#!/usr/bin/env bash
# Build llama.cpp's llama-server (the CPU peer for `radixserve bench compare`)
# from the sources in the llama-cpp-python sdist, and make F32/BF16 GGUFs of
# the default model.  Opt-in: nothing in CI depends on it.
#
#   bash scripts/build_llama_server.sh [CACHE_DIR]   # default ~/.cache/radixserve/peer
#
# About 10 minutes on 2 idle cores.  AMX is off on purpose: with native flags
# llama.cpp's AMX Q4_1 kernel dies with an illegal instruction on these machines.
set -euo pipefail
CACHE="${1:-$HOME/.cache/radixserve/peer}"
VERSION=0.3.36
PY="${PYTHON:-$(pwd)/.venv/bin/python}"
mkdir -p "$CACHE"
cd "$CACHE"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -x "$SRC/build/bin/llama-server" ] || [ ! -x "$SRC/build/bin/llama-quantize" ]; then
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  cmake --build "$SRC/build" -j "$(nproc)" --target llama-server llama-quantize llama-bench
fi
ln -sf "$SRC/build/bin/llama-server" "$CACHE/llama-server"
ln -sf "$SRC/build/bin/llama-bench" "$CACHE/llama-bench"
GGUF="$("$PY" -c 'from radixserve.models.gguf import default_gguf; print(default_gguf())')"
for T in F32 BF16; do
  OUT="$CACHE/SmolLM2-135M-Instruct.$T.gguf"
  [ -f "$OUT" ] || "$SRC/build/bin/llama-quantize" --allow-requantize "$GGUF" "$OUT" "$T"
done
echo "llama-server: $CACHE/llama-server"
ls -la "$CACHE"/*.gguf
