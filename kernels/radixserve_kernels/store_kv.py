"""Write new K/V rows into the pool: `k_pool[slots[t]] = k[t]` (and v), for T rows.

k/v are (T, kv_heads, head_dim), any strides (they are often views of a fused qkv
projection); the pools are (num_slots, kv_heads, head_dim) with contiguous rows. A quantized
pool (int8 or fp8 e4m3, kernels/radixserve_kernels/kv_quant.py) also takes each row's scale into its scale
tensors (num_slots, kv_heads) fp32: `store_kv_quant`.
"""

from __future__ import annotations

import torch

from radixserve_kernels import cpu
from radixserve_kernels._triton import built, next_pow2, use_triton
from radixserve_kernels.kv_quant import quantize


def store_kv_ref(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k_pool.index_copy_(0, slots, k)
    v_pool.index_copy_(0, slots, v)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Dispatcher: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the native kernel
    on CPU where it is built (both pools in one call), torch elsewhere."""
    if slots.numel() == 0:
        return
    if use_triton(k_pool):
        store_kv_triton(k_pool, v_pool, slots, k, v)
    elif (ops := cpu.native_for(k_pool)) is not None and k.dtype == k_pool.dtype and v.dtype == v_pool.dtype:
        ops.store_kv(k_pool, v_pool, slots.long(), k, v)
    else:
        store_kv_ref(k_pool, v_pool, slots, k, v)


def store_kv_quant_ref(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                       slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for x, pool, scales in ((k, k_pool, k_scale), (v, v_pool, v_scale)):
        q, s = quantize(x, pool.dtype)
        pool.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))  # as bytes: no fp8 index_copy_ on CPU
        scales.index_copy_(0, slots, s)


def store_kv_quant(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Dispatcher: the native kernel on CPU where it is built (fp32 or bf16 k/v), torch
    elsewhere (on CUDA too: a few elementwise ops per layer, no Triton kernel yet)."""
    if slots.numel() == 0:
        return
    if (ops := cpu.native_for(k)) is not None and v.dtype == k.dtype:
        ops.store_kv_quant(k_pool, v_pool, k_scale, v_scale, slots.long(), k, v)
    else:
        store_kv_quant_ref(k_pool, v_pool, k_scale, v_scale, slots, k, v)


def store_kv_triton(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    t, heads, dim = k.shape
    assert k_pool.stride(2) == 1 and k_pool.stride(1) == dim, "pool rows must be contiguous"
    block = next_pow2(heads * dim)
    kernel = built("store_kv", _build)
    for src, dst in ((k, k_pool), (v, v_pool)):
        kernel[(t,)](src, dst, slots, src.stride(0), src.stride(1), src.stride(2), dst.stride(0), heads * dim, dim, BLOCK=block)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(src, dst, slots, s_t, s_h, s_d, d_slot, row_len, dim, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK)
        ok = e < row_len
        slot = tl.load(slots + t).to(tl.int64)
        x = tl.load(src + t.to(tl.int64) * s_t + (e // dim) * s_h + (e % dim) * s_d, mask=ok)
        tl.store(dst + slot * d_slot + e, x, mask=ok)

    return store_kv_kernel
