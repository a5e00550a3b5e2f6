"""Decode attention over paged KV: one query token per request, attending to the KV slots
its row of the slot table lists (GQA: `heads` a multiple of `kv_heads`).

    q, out     (T, heads, dim)     flat rows; request b reads and writes row q_rows[b]
    k/v_pool   (slots, kv_heads, dim)
    table      (B, width) int      slot of each position; only the first seq_lens[b] are read
    seq_lens   (B,) int

The Triton kernel splits each request's KV into `num_splits` parts (so a few long requests
still fill the GPU), computes each part's output and log-sum-exp for all the query heads of
one KV head at once (K/V read once per group), and a second pass merges the parts. On CPU
the native kernel (kernels/radixserve_kernels/cpu.py) does the same per (request, KV head), single-pass over
the slots, reading the pool in place; it can also return each row's log-sum-exp (lse, (B,
heads) fp32), so a caller can merge it with attention over other keys. Given the scales of a
quantized pool (int8 or fp8 e4m3 values, k/v_scale (slots, kv_heads) fp32, kernels/radixserve_kernels/kv_quant.py)
the reference dequantizes the rows it reads and the native kernel reads the quantized rows in
place: each K row's scale multiplies its score, each V row's scale its softmax weight.
"""

from __future__ import annotations

import torch

from radixserve_kernels import cpu
from radixserve_kernels._triton import interpreting, next_pow2, precise, use_triton
from radixserve_kernels.kv_quant import dequantize


def decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                         table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None,
                         lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """The torch reference: one request at a time, in fp32."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[1]
    scale = dim**-0.5 if sm_scale is None else sm_scale

    def rows(pool: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        x = pool.index_select(0, slots)
        x = x.float() if scales is None else dequantize(x, scales.index_select(0, slots), torch.float32)
        return x.repeat_interleave(group, 1)  # (n, heads, dim)

    for b in range(table.shape[0]):
        slots = table[b, : int(seq_lens[b])].long()
        k, v = rows(k_pool, k_scale, slots), rows(v_pool, v_scale, slots)
        row = int(q_rows[b])
        scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * scale
        if lse is not None:
            lse[b] = torch.logsumexp(scores, -1)
        p = torch.softmax(scores, -1)
        out[row] = torch.einsum("hn,nhd->hd", p, v).to(out.dtype)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                     table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None) -> None:
    """Dispatcher: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), the native kernel
    on CPU where it is built, torch elsewhere."""
    if table.shape[0] == 0:
        return
    if use_triton(q):
        decode_attention_triton(q, k_pool, v_pool, out, q_rows, table, seq_lens, sm_scale)
    elif cpu.native_for(q) is not None:
        decode_attention_cpu(q, k_pool, v_pool, out, q_rows, table, seq_lens, sm_scale)
    else:
        decode_attention_ref(q, k_pool, v_pool, out, q_rows, table, seq_lens, sm_scale)


def decode_attention_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                         table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None,
                         lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """The native CPU kernel (int64 rows/table/lengths); with k/v_scale, over a quantized
    pool. Raises if it is not built."""
    ops = cpu.native_for(q)
    if ops is None:
        raise RuntimeError("radixserve's CPU kernels are not built here (see kernels/radixserve_kernels/cpu.py)")
    scale = q.shape[2] ** -0.5 if sm_scale is None else sm_scale
    rows, table, lens = q_rows.long(), table.long(), seq_lens.long()
    if k_scale is None or v_scale is None:
        ops.decode_attention(q, k_pool, v_pool, out, lse, rows, table, lens, scale)
    else:
        ops.decode_attention_quant(q, k_pool, v_pool, k_scale, v_scale, out, lse, rows, table, lens, scale)


def num_splits(programs: int, width: int, block_n: int) -> int:
    """Enough parts to give the GPU ~512 programs, each part at least two KV blocks long."""
    return max(1, min(-(-width // (2 * block_n)), -(-512 // max(programs, 1)), 64))


def decode_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                            table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None,
                            splits: int | None = None) -> None:
    batch, width = table.shape
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and table.stride(1) == 1
    block_n = 64 if not interpreting() else 32
    splits = splits or num_splits(batch * kv_heads, width, block_n)
    mid_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    scale = dim**-0.5 if sm_scale is None else sm_scale
    from radixserve_kernels import _paged_jit as jit  # imports triton: only once a kernel runs

    jit.decode_partial[(batch, kv_heads, splits)](
        q, k_pool, v_pool, table, seq_lens, q_rows, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), table.stride(0),
        scale, group, dim, splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(dim)), PRECISE=precise(q.dtype))
    jit.decode_reduce[(batch, heads)](mid_o, mid_lse, out, q_rows, out.stride(0), out.stride(1), dim, splits,
                                     BLOCK_S=max(2, next_pow2(splits)), BLOCK_D=max(16, next_pow2(dim)))

