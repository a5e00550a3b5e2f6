"""Plumbing shared by the Triton kernels: when to use them, and building them lazily.

`triton.jit` decides at decoration time whether a kernel runs compiled or under the
interpreter (TRITON_INTERPRET=1), so kernels are built on first use and cached per mode:
importing triton is not free, and a test can switch the interpreter on for itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

_BUILT: dict[tuple[str, bool], Any] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of every op: Triton on CUDA or under the interpreter, torch elsewhere."""
    return t.is_cuda or interpreting()


def built(name: str, build: Callable[[], Any]) -> Any:
    key = (name, interpreting())
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def precise(dtype: torch.dtype) -> bool:
    """Whether attention kernels multiply in fp32 with IEEE products: for fp32 inputs (tensor
    cores would round them to tf32), and under the interpreter, whose bf16 `tl.dot` is wrong.
    On a GPU, bf16 and fp16 inputs take the tensor-core path."""
    return dtype == torch.float32 or interpreting()
