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

from kernels._triton import built, interpreting, next_pow2, precise, use_triton


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
    kernel = built("extend_attention", _build)
    grid = (table.shape[0], heads, -(-max_q_len // block))
    kernel[grid](q, k_pool, v_pool, out, q_starts, q_lens, prefix_lens, table,
                 q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
                 out.stride(0), out.stride(1), table.stride(0), dim**-0.5 if sm_scale is None else sm_scale, group, dim,
                 BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, next_pow2(dim)), PRECISE=precise(q.dtype))


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def extend_kernel(q, k_pool, v_pool, out, q_starts, q_lens, prefix_lens, table,
                      s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_ot, s_oh, s_tb, scale, group, dim,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISE: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        m0 = tl.program_id(2) * BLOCK_M
        q_len = tl.load(q_lens + i)
        prefix = tl.load(prefix_lens + i)
        q_start = tl.load(q_starts + i).to(tl.int64)
        kh = h // group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < q_len
        d_ok = offs_d < dim
        qv = tl.load(q + (q_start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                     other=0.0)
        pos = prefix + offs_m  # each query's position: it sees keys 0 .. pos
        kv_end = tl.where(m0 < q_len, prefix + tl.minimum(m0 + BLOCK_M, q_len), 0)  # a block past the chunk does nothing
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            slot = tl.load(table + i.to(tl.int64) * s_tb + offs_n, mask=n_ok, other=0).to(tl.int64)
            kv_ok = n_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_pool + slot[:, None] * s_ks + kh * s_kh + offs_d[None, :], mask=kv_ok, other=0.0)
            vt = tl.load(v_pool + slot[:, None] * s_vs + kh * s_vh + offs_d[None, :], mask=kv_ok, other=0.0)
            if PRECISE:
                s = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kt))
            visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            s = tl.where(visible, s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: key 0 is visible to every row in the first block
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            if PRECISE:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m = m_new
        res = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out + (q_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :], res.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])

    return extend_kernel
