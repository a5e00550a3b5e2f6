"""Quantized KV rows: int8 or fp8 (e4m3) values with one scale per (token, KV head).

    scale = max(absmax(x over head_dim) / QMAX, fp32's smallest normal)
    q     = clamp(x / scale, -QMAX, QMAX), then rounded: int8 to nearest even, fp8 by its cast
    x    ~= q * scale

int8 is symmetric (QMAX 127; -128 is never stored), fp8 e4m3 uses its largest finite value
(QMAX 448), so neither ever stores a NaN. Scales are fp32: 4 bytes per head row against the
64-128 bytes of its values (3-6% of an int8 row at head_dim 128-64), for scales that are exact
in the kernels' fp32 arithmetic and that no row's range can underflow or overflow (fp16 would
flush a row of values below ~1e-3 to subnormal scales). These are the references the native
store and read (kernels/radixserve_kernels/csrc/kv_store.cpp, attention.cpp) are tested against, bit for bit on the store.
"""

from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., dim) -> (values (..., dim) in dtype, scales (...) fp32)."""
    qmax = QMAX[dtype]
    scale = (x.abs().amax(-1).float() / qmax).clamp_min_(torch.finfo(SCALE_DTYPE).tiny)
    y = (x.float() / scale[..., None]).clamp_(-qmax, qmax)
    return (y.round_() if dtype == torch.int8 else y).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., dim) and scales (...) -> (..., dim) in dtype."""
    return (q.float() * scale[..., None]).to(dtype)
