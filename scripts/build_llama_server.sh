#!/usr/bin/env bash
# Build llama.cpp's llama-server (the CPU peer for `radixserve bench compare`),
# llama-bench, llama-quantize and llama-perplexity (the peer's side of
# `radixserve bench quality`: docs/quantization.md) from the sources in the
# llama-cpp-python sdist, and make F32/BF16 GGUFs of the default model.
# Opt-in: nothing in CI depends on it.
#
#   bash scripts/build_llama_server.sh [CACHE_DIR]   # default ~/.cache/radixserve/peer
#   bash scripts/build_llama_server.sh --avx2 [CACHE_DIR]
#
# --avx2 builds the peer an AVX2-only CPU would have (AVX, AVX2, FMA, F16C, BMI2;
# no AVX-512), as $CACHE/llama-server-avx2, so that the AVX2 column of the
# README's table can be measured on an AVX-512 machine against the llama.cpp
# that such a CPU would run (beside RADIXSERVE_CPU_ISA=avx2). x86-64 only.
#
# About 10 minutes on 2 idle cores.  The build is native (-DGGML_NATIVE=ON, i.e.
# -march=native), so it is only valid on the CPU class it was built on: an
# explicit -DGGML_AVX512=ON build, for instance, dies with an illegal instruction
# on an AVX2-only CPU.  So each build lives in its own directory keyed by the
# CPU's flags (build-<first 12 hex of sha256 of /proc/cpuinfo's 'flags' line>,
# i.e. `grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12`);
# a cache carried to another CPU class builds afresh instead of crashing, and
# $CACHE/llama-server and $CACHE/llama-bench point at this CPU's build.
# AMX is off on purpose: llama.cpp's AMX Q4_1 kernel dies with an illegal
# instruction on these machines.  With GGML_NATIVE=ON llama.cpp ignores the
# GGML_AMX_* options (-march=native turns AMX on wherever the CPU reports it), so
# AMX is also switched off with -mno-amx-* compiler flags, which gcc (12, checked)
# applies after its -march=native expansion.
set -euo pipefail
AVX2=0
if [ "${1:-}" = --avx2 ]; then AVX2=1; shift; fi
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
if [ "$AVX2" = 1 ]; then
  BUILD="$SRC/build-avx2"
  if [ ! -x "$BUILD/bin/llama-server" ]; then
    echo "building llama.cpp for AVX2-only CPUs in $BUILD"
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$BUILD" -j "$(nproc)" --target llama-server
  fi
  ln -sfn "$BUILD/bin/llama-server" "$CACHE/llama-server-avx2"
  "$CACHE/llama-server-avx2" --version
  echo "llama-server (AVX2 build): $CACHE/llama-server-avx2"
  exit 0
fi
CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo || true)"
[ -n "$CPU_FLAGS" ] || CPU_FLAGS="$(uname -m) $(grep -m1 '^Features' /proc/cpuinfo || true)"
CPU_KEY="$(echo "$CPU_FLAGS" | sha256sum | cut -c1-12)"
BUILD="$SRC/build-$CPU_KEY"
NO_AMX=""
[ "$(uname -m)" != x86_64 ] || NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-quantize" ] \
    || [ ! -x "$BUILD/bin/llama-bench" ] || [ ! -x "$BUILD/bin/llama-perplexity" ]; then
  echo "building llama.cpp natively for this CPU in $BUILD"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  cmake --build "$BUILD" -j "$(nproc)" --target llama-server llama-quantize llama-bench llama-perplexity
fi
for TOOL in llama-server llama-bench llama-quantize llama-perplexity; do ln -sfn "$BUILD/bin/$TOOL" "$CACHE/$TOOL"; done
"$CACHE/llama-server" --version
GGUF="$("$PY" -c 'from radixserve.models.gguf import default_gguf; print(default_gguf())')"
for T in F32 BF16; do
  OUT="$CACHE/SmolLM2-135M-Instruct.$T.gguf"
  [ -f "$OUT" ] || "$BUILD/bin/llama-quantize" --allow-requantize "$GGUF" "$OUT" "$T"
done
echo "llama-server: $CACHE/llama-server"
ls -la "$CACHE"/*.gguf
