"""radixserve installed from its wheel into a fresh venv beside the newest transformers and
Hugging Face's `kernels` (which transformers >= 5.25 imports, and whose name our kernels/ folder
once shadowed): it imports, its wheel carries the C++ sources, the prebuild step runs, and it
serves transformers' tokens and log-probabilities (scripts/fresh_env_check.py).

The venv's packages come from the package index, as a user's do (about a minute); torch is
pinned to the running one, which is a local CPU build here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str | Path, cwd: Path) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_wheel_installs_and_serves_beside_the_newest_transformers_and_hf_kernels(tiny_llama, tmp_path):
    src = tmp_path / "src"  # what the wheel is built from, without the checkout's build/ or caches
    for name in ("radixserve", "grammars", "kernels", "frontend_lang"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, src, cwd=tmp_path)
    (wheel,) = wheels.glob("radixserve-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    pip = (py, "-m", "pip", "install", "-q", "--disable-pip-version-check")
    _run(*pip, f"torch=={torch.__version__.split('+')[0]}", cwd=tmp_path)
    _run(*pip, wheel, "--upgrade", "transformers", "kernels", cwd=tmp_path)
    listed = _run(py, "-m", "pip", "list", "--format=freeze", cwd=tmp_path)
    assert "kernels==" in listed and "transformers==" in listed
    out = _run(py, ROOT / "scripts" / "fresh_env_check.py", tiny_llama, ROOT, cwd=tmp_path)
    assert "fresh environment: ok" in out, out
