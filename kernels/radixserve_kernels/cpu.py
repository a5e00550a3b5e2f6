"""radixserve's native CPU kernels (csrc/), one build per instruction set, the best one chosen at
run time.

The sources are one file per op family over one vector layer (csrc/vec.h):

    attention.cpp      decode_attention, decode_attention_quant      radixserve_kernels.decode_attention.decode_attention_ref
    kv_store.cpp       store_kv, store_kv_quant                      radixserve_kernels.store_kv.store_kv_ref / store_kv_quant_ref
    norm_rope_act.cpp  rms_norm, rope_, silu_and_mul                 F.rms_norm, models.layers.apply_rope, F.silu * up
    lora.cpp           lora_add_                                     radixserve_kernels.lora.lora_add_ref
    linear.cpp         pack_linear, linear, linear_supports          F.linear
    quant_linear.cpp   pack_quant, dequant_quant, qlinear            gguf-py, radixserve_kernels.quant_matmul.dequant_ref
    kquant_linear.cpp  (the same, for Q5_0/Q5_1/Q4_K/Q5_K/Q6_K)     gguf-py, tests/test_quant.py reference_qlinear
    amx.h              both families' AMX-INT8 tiles (32+ rows)      the VNNI tiles, bit for bit
    decode_step.cpp    decode_layers                                 the same ops layer by layer (models.llama.FusedDecode)
    ops.cpp            the module (and `isa()`, the build's name)

Instruction sets (`ISAS`, best first): `avx512` (AVX-512 F/BW/DQ/VL, plus VNNI, BF16 and the
AMX-INT8 tiles where the CPU has them), `avx2` (AVX2 + FMA + F16C: every x86-64 CPU of the last decade), `generic`
(portable C++, any CPU). `ops()` loads the best one this CPU runs, or the one named by
RADIXSERVE_CPU_ISA (`avx2` on an AVX-512 machine measures the AVX2 kernels there); a log line
names it. `ops_for(isa)` loads any other one this CPU runs (the tests compare them).

Builds are made by `python -m radixserve_kernels.cpu` at install time (scripts/setup.sh builds every
variant this CPU runs, about a minute each on two cores) into ~/.cache/radixserve/kernels or
$RADIXSERVE_KERNEL_CACHE, keyed by the sources, the flags, torch and Python; a missing build is
made at first use instead (with a log line saying so). A finished build (its `complete` marker is
written after the link) is loaded as it is: ninja is not asked again whether it is current (a
fresh checkout's newer file times, or another ninja version's build log, made it recompile
everything at the next server start). `ops()` is None where no build can be had (no C++
compiler) or with RADIXSERVE_CPU_KERNELS=0: callers then use the torch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
ISAS = ("avx512", "avx2", "generic")  # best first
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}
_enabled = os.environ.get("RADIXSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")
_isa: str | None = None  # set_isa's choice, over RADIXSERVE_CPU_ISA


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Switch the kernels on or off for this process (`--disable-cpu-kernels`)."""
    global _enabled
    _enabled = on


def set_isa(isa: str | None) -> None:
    """Use this build for the rest of the process (None: back to RADIXSERVE_CPU_ISA / the best)."""
    global _isa
    if isa is not None and isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r} (one of {', '.join(ISAS)})")
    _isa = isa


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags, read once (ops() asks for its build on every kernel call)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((frozenset(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), frozenset())
    except OSError:
        return frozenset()


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds this CPU can run, best first."""
    flags = cpu_flags() if flags is None else flags
    out = []
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"} <= flags:
        out.append("avx512")
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    return out + ["generic"]


def isa_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The compiler flags of one build: the instruction set, and for avx512 the extensions
    (VNNI, BF16, AMX-INT8) this CPU has."""
    flags = cpu_flags() if flags is None else flags
    if isa == "avx2":
        return _AVX2
    if isa == "avx512":
        extra = [f for f, name in (("-mavx512vnni", "avx512_vnni"), ("-mavx512bf16", "avx512_bf16")) if name in flags]
        if {"amx_tile", "amx_int8", "avx512_vnni"} <= flags:  # the AMX tiles (csrc/amx.h)
            extra += ["-mamx-tile", "-mamx-int8"]
        return _AVX2 + _AVX512 + extra
    if isa == "generic":
        return []
    raise ValueError(f"unknown instruction set {isa!r} (one of {', '.join(ISAS)})")


def chosen_isa() -> str:
    """set_isa's or RADIXSERVE_CPU_ISA's build if this CPU runs it (else a warning), otherwise
    the best it runs."""
    runnable = runnable_isas()
    want = _isa or os.environ.get("RADIXSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if want == "auto":
        return runnable[0]
    if want not in ISAS:
        log.warning("RADIXSERVE_CPU_ISA=%s is not one of auto, %s; using %s", want, ", ".join(ISAS), runnable[0])
        return runnable[0]
    if want not in runnable:
        log.warning("RADIXSERVE_CPU_ISA=%s: this CPU cannot run it; using %s", want, runnable[0])
        return runnable[0]
    return want


def ops() -> ModuleType | None:
    """The built kernels for `chosen_isa()`, or None (see the module docstring)."""
    if not enabled():
        return None
    return ops_for(chosen_isa())


def native_for(x: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
    """The kernels if they apply to x (a CPU tensor of fp32 or bf16) and no tensor given needs
    a gradient (they have no backward), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return None
    return ops()


def ops_for(isa: str) -> ModuleType | None:
    """One build (made now if it is not cached), or None if it cannot be had."""
    if isa not in _state:
        with _lock:
            if isa not in _state:
                _state[isa] = _build(isa)
    return _state[isa]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_dir(isa: str) -> Path:
    """One build per sources, flags, torch and Python (the flags say which instructions it uses)."""
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
    parts = [p.name.encode() + b"\0" + p.read_bytes() for p in files]
    parts += [" ".join(BASE_FLAGS + isa_flags(isa)).encode(), torch.__version__.encode(), sys.version.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = Path(os.environ.get("RADIXSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "radixserve" / "kernels")
    return root / f"{isa}-{key}"


def _build(isa: str) -> ModuleType | None:
    if isa not in runnable_isas():
        log.warning("radixserve's %s CPU kernels cannot run on this CPU", isa)
        return None
    where = build_dir(isa)
    name = f"radixserve_cpu_ops_{isa}"
    try:
        if (where / _DONE).exists():  # the directory's key names its sources and flags: no rebuild check
            return _announce(_import_so(name, where / f"{name}.so"), isa, "cached")
        from torch.utils import cpp_extension

        # Always the venv's own ninja: two ninja versions (a system one and pip's) each discard the
        # other's build log, and then every build recompiles everything.
        scripts = str(Path(sys.executable).parent)
        if (Path(scripts) / "ninja").exists() and not os.environ.get("PATH", "").startswith(scripts + os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        where.mkdir(parents=True, exist_ok=True)
        log.info("building radixserve's %s CPU kernels into %s (once; `python -m radixserve_kernels.cpu` at install)", isa, where)
        t0 = time.perf_counter()
        mod = cpp_extension.load(name=name, sources=[str(s) for s in sources()],
                                 extra_cflags=BASE_FLAGS + isa_flags(isa), extra_include_paths=[str(CSRC)],
                                 extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)
        (where / _DONE).write_text(mod.isa() + "\n")
        return _announce(mod, isa, "built in %.0f s" % (time.perf_counter() - t0))
    except Exception as e:  # no compiler, no ninja, a failed build: the torch ops still work
        log.warning("radixserve's %s CPU kernels are not available (%s); using torch ops", isa,
                    str(e).splitlines()[0] if str(e) else repr(e))
        return None


_DONE = "complete"  # written once a build has linked: a directory without it is (re)built


def _import_so(name: str, so: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, so)
    assert spec is not None and spec.loader is not None, so
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _announce(mod: ModuleType, isa: str, how: str) -> ModuleType:
    log.info("radixserve CPU kernels: %s (%s)%s", mod.isa(), how,
             "" if isa == runnable_isas()[0] else f"; this CPU also runs {runnable_isas()[0]}")
    return mod


def main(argv: list[str] | None = None) -> int:
    """`python -m radixserve_kernels.cpu [ISA ...]`: build the kernels (by default every variant this CPU
    runs, best first) so that no server start pays for it."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m radixserve_kernels.cpu", description=main.__doc__)
    p.add_argument("isas", nargs="*", help=f"which builds (default: every one this CPU runs; of {', '.join(ISAS)})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = 0
    for isa in args.isas or runnable_isas():
        mod = ops_for(isa)
        print(f"{isa}: {mod.isa() if mod else 'FAILED'} in {build_dir(isa)}")
        failed += mod is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
