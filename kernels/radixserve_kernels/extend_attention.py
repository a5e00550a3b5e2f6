"""Extend attention over paged KV: each request feeds a chunk of new tokens that attends
causally to itself and fully to the request's cached prefix (prefill, chunked prefill, and
the uncached rest of a prompt after a radix-cache hit).

    q, out       (T, heads, dim)      flat rows; request i owns rows q_starts[i] .. + q_lens[i]
    k/v_pool     (slots, kv_heads, dim), the chunk's own K/V already stored (store_kv)
    table        (N, width) int       KV slots of request i: prefix_lens[i] + q_lens[i] of them
    q_starts, q_lens, prefix_lens     (N,) int

Query j of request i sits at position prefix_lens[i] + j and sees KV positions 0 .. that.
"""

from __future__ import annotations

import torch

from radixserve_kernels._triton import interpreting, next_pow2, precise, use_triton


def extend_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_starts: torch.Tensor,
                         q_lens: torch.Tensor, prefix_lens: torch.Tensor, table: torch.Tensor,
                         sm_scale: float | None = None) -> None:
    """The torch reference: one request at a time, in fp32, with an explicit causal mask."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[1]
    scale = dim**-0.5 if sm_scale is None else sm_scale
    for i in range(table.shape[0]):
        start, n, prefix = int(q_starts[i]), int(q_lens[i]), int(prefix_lens[i])
        slots = table[i, : prefix + n].long()
        k = k_pool.index_select(0, slots).float().repeat_interleave(group, 1)  # (L, heads, dim)
        v = v_pool.index_select(0, slots).float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * scale
        visible = torch.arange(prefix + n, device=q.device)[None, :] <= (torch.arange(n, device=q.device) + prefix)[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, prefix_lens: torch.Tensor, table: torch.Tensor, max_q_len: int,
                     sm_scale: float | None = None) -> None:
    """Dispatcher: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), torch elsewhere.
    `max_q_len` (the longest chunk) sizes the grid without reading the lengths back."""
    if table.shape[0] == 0:
        return
    if use_triton(q):
        extend_attention_triton(q, k_pool, v_pool, out, q_starts, q_lens, prefix_lens, table, max_q_len, sm_scale)
    else:
        extend_attention_ref(q, k_pool, v_pool, out, q_starts, q_lens, prefix_lens, table, sm_scale)


def extend_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_starts: torch.Tensor,
                            q_lens: torch.Tensor, prefix_lens: torch.Tensor, table: torch.Tensor, max_q_len: int,
                            sm_scale: float | None = None) -> None:
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and table.stride(1) == 1
    block = 32 if interpreting() or dim > 128 else 64
    from radixserve_kernels import _paged_jit as jit  # imports triton: only once a kernel runs

    grid = (table.shape[0], heads, -(-max_q_len // block))
    jit.extend_kernel[grid](q, k_pool, v_pool, out, q_starts, q_lens, prefix_lens, table,
                            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
                            out.stride(0), out.stride(1), table.stride(0), dim**-0.5 if sm_scale is None else sm_scale, group,
                            dim, BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, next_pow2(dim)), PRECISE=precise(q.dtype))

