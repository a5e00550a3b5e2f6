"""Which threads start OpenMP teams: only the one that runs the model.

torch's CPU ops and the native kernels split their work with OpenMP (at::parallel_for). Every
thread that runs a parallel op becomes the master of its own team, whose workers stay alive
(idle) for as long as that thread lives. GNU OpenMP (libgomp, torch's runtime on Linux) counts
all of them, and while they outnumber the CPUs it stops spin-waiting at its barriers: each
parallel region's workers sleep and must be woken, 6-7x slower for a small region on a 2-core
machine. A helper thread that once zeroed a bitmask of 16 rows (a parallel fill) cost every later
decode step of the model's thread a third of its speed, for the process's life.

So: a helper thread that may run torch ops calls `helper_thread()` first (its ops run serially,
it never starts a team; also a ThreadPoolExecutor `initializer`), and a thread that ran parallel
ops (loaded the model) before handing the model to another calls `release_workers()`.
Without an OpenMP runtime that exports these calls (another platform), both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

_NAMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _runtime() -> Any:
    """The OpenMP runtime torch loaded (found in this process's maps), or None."""
    torch.get_num_threads()  # (loads it)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(n in line for n in _NAMES) and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # the loaded library: dlopen of a loaded path returns it
            lib.omp_set_num_threads, lib.omp_pause_resource_all  # noqa: B018 (both present)
        except (OSError, AttributeError):
            continue
        return lib
    return None


def helper_thread() -> None:
    """Make this thread's torch ops serial: it will not start an OpenMP team of its own."""
    torch.get_num_threads()  # torch's per-thread set-up first (it would set this thread's count back)
    lib = _runtime()
    if lib is not None:
        lib.omp_set_num_threads(1)


def release_workers() -> None:
    """End this thread's idle OpenMP workers (omp_pause_resource_all, soft): the model's thread,
    now another one, is then the only team. A later parallel op here starts them again."""
    lib = _runtime()
    if lib is not None:
        lib.omp_pause_resource_all(1)  # omp_pause_soft
