"""radixserve's native CPU kernels (csrc/cpu_ops.cpp), built on first use and cached.

The ops, each with the torch reference it is tested against (tests/test_cpu_kernels.py):

    decode_attention(q, k_pool, v_pool, out, lse, q_rows, table, seq_lens, scale)
                                        kernels.decode_attention.decode_attention_ref
    rms_norm(x, residual, weight, eps)  F.rms_norm (after x + residual)
    rope_(q, k, cos, sin)               radixserve.models.layers.apply_rope
    silu_and_mul(x)                     F.silu(x[..., :n]) * x[..., n:]
    store_kv(k_pool, v_pool, slots, k, v)
                                        kernels.store_kv.store_kv_ref
    decode_attention_quant(q, k_pool, v_pool, k_scale, v_scale, out, lse, q_rows, table, seq_lens, scale)
                                        decode_attention_ref (given the scales)
    store_kv_quant(k_pool, v_pool, k_scale, v_scale, slots, k, v)
                                        kernels.store_kv.store_kv_quant_ref
    pack_linear(w), linear(x, packed, n, bias, float_out), linear_supports(w)
                                        F.linear
    decode_layers(...)                  the same ops called layer by layer
                                        (radixserve.models.llama.FusedDecode)

`ops()` returns the built module, or None where it cannot be had: not on a CPU with a C++
compiler, or RADIXSERVE_CPU_KERNELS=0 (then callers use the torch ops). The build (about
half a minute on two cores) happens once per source, flags, torch, Python and CPU, into
~/.cache/radixserve/kernels or $RADIXSERVE_KERNEL_CACHE; `-march=native`, since it is built
on the machine that runs it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
_enabled = os.environ.get("RADIXSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")


def enabled() -> bool:
    return _enabled


def ops() -> ModuleType | None:
    """The built kernels, or None (see the module docstring). Builds on the first call."""
    if not enabled():
        return None
    if "mod" not in _state:
        with _lock:
            if "mod" not in _state:
                _state["mod"] = _build()
    return _state["mod"]


def native_for(x: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
    """The kernels if they apply to x (a CPU tensor of fp32 or bf16) and no tensor given needs
    a gradient (they have no backward), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return None
    return ops()


def set_enabled(on: bool) -> None:
    """Switch the kernels on or off for this process (`--disable-cpu-kernels`)."""
    global _enabled
    _enabled = on


def build_dir() -> Path:
    """One build per source, flags, torch, Python and CPU (-march=native code is the CPU's)."""
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(), sys.version.encode(), _cpu_id()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = Path(os.environ.get("RADIXSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "radixserve" / "kernels")
    return root / key


def _cpu_id() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return b"".join(line for line in f if line.startswith((b"model name", b"flags")))
    except OSError:
        return platform.processor().encode()


def _build() -> ModuleType | None:
    try:
        from torch.utils import cpp_extension

        scripts = str(Path(sys.executable).parent)  # a venv's ninja, when the venv is not activated
        if shutil.which("ninja") is None and scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        where = build_dir()
        where.mkdir(parents=True, exist_ok=True)
        if not any(where.glob("*.so")):
            log.info("building radixserve's CPU kernels into %s (once; about half a minute)", where)
        return cpp_extension.load(name="radixserve_cpu_ops", sources=[str(SOURCE)], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch ops still work
        log.warning("radixserve's CPU kernels are not available (%s); using torch ops", str(e).splitlines()[0] if str(e) else repr(e))
        return None
