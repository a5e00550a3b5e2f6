"""Decode attention over paged KV: one query token per request, attending to the KV slots
its row of the slot table lists (GQA: `heads` a multiple of `kv_heads`).

    q, out     (T, heads, dim)     flat rows; request b reads and writes row q_rows[b]
    k/v_pool   (slots, kv_heads, dim)
    table      (B, width) int      slot of each position; only the first seq_lens[b] are read
    seq_lens   (B,) int

The Triton kernel splits each request's KV into `num_splits` parts (so a few long requests
still fill the GPU), computes each part's output and log-sum-exp for all the query heads of
one KV head at once (K/V read once per group), and a second pass merges the parts.
"""

from __future__ import annotations

import torch

from kernels._triton import built, interpreting, next_pow2, precise, use_triton


def decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                         table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None) -> None:
    """The torch reference: one request at a time, in fp32."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[1]
    scale = dim**-0.5 if sm_scale is None else sm_scale
    for b in range(table.shape[0]):
        slots = table[b, : int(seq_lens[b])].long()
        k = k_pool.index_select(0, slots).float().repeat_interleave(group, 1)  # (n, heads, dim)
        v = v_pool.index_select(0, slots).float().repeat_interleave(group, 1)
        row = int(q_rows[b])
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[row].float(), k) * scale, -1)
        out[row] = torch.einsum("hn,nhd->hd", p, v).to(out.dtype)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor, q_rows: torch.Tensor,
                     table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None) -> None:
    """Dispatcher: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), torch elsewhere."""
    if table.shape[0] == 0:
        return
    if use_triton(q):
        decode_attention_triton(q, k_pool, v_pool, out, q_rows, table, seq_lens, sm_scale)
    else:
        decode_attention_ref(q, k_pool, v_pool, out, q_rows, table, seq_lens, sm_scale)


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
    partial, reduce = built("decode_attention", _build)
    partial[(batch, kv_heads, splits)](
        q, k_pool, v_pool, table, seq_lens, q_rows, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), table.stride(0),
        scale, group, dim, splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(dim)), PRECISE=precise(q.dtype))
    reduce[(batch, heads)](mid_o, mid_lse, out, q_rows, out.stride(0), out.stride(1), dim, splits,
                           BLOCK_S=max(2, next_pow2(splits)), BLOCK_D=max(16, next_pow2(dim)))


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_partial(q, k_pool, v_pool, table, seq_lens, q_rows, mid_o, mid_lse,
                       s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_tb,
                       scale, group, dim, splits,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISE: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(seq_lens + b)
        part = tl.cdiv(seq_len, splits)
        start = sp * part
        end = tl.minimum(start + part, seq_len)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_ok = offs_h < group
        d_ok = offs_d < dim
        head = kh * group + offs_h
        row = tl.load(q_rows + b).to(tl.int64)
        qv = tl.load(q + row * s_qt + head[:, None] * s_qh + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            slot = tl.load(table + b.to(tl.int64) * s_tb + offs_n, mask=n_ok, other=0).to(tl.int64)
            kv_ok = n_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_pool + slot[:, None] * s_ks + kh * s_kh + offs_d[None, :], mask=kv_ok, other=0.0)
            vt = tl.load(v_pool + slot[:, None] * s_vs + kh * s_vh + offs_d[None, :], mask=kv_ok, other=0.0)
            if PRECISE:
                s = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kt))
            s = tl.where(n_ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 1)
            if PRECISE:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m = m_new
        safe = tl.where(denom > 0, denom, 1.0)
        base = (b * tl.num_programs(1) * group + head).to(tl.int64) * splits + sp  # mid is (B, heads, splits, ...)
        tl.store(mid_o + base[:, None] * dim + offs_d[None, :], acc / safe[:, None], mask=h_ok[:, None] & d_ok[None, :])
        tl.store(mid_lse + base, tl.where(denom > 0, m + tl.log(safe), float("-inf")), mask=h_ok)

    @triton.jit
    def decode_reduce(mid_o, mid_lse, out, q_rows, s_ot, s_oh, dim, splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < splits
        base = (b * tl.num_programs(1) + h).to(tl.int64) * splits
        lse = tl.load(mid_lse + base + offs_s, mask=s_ok, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # part 0 is never empty: the max is finite
        o = tl.load(mid_o + (base + offs_s)[:, None] * dim + offs_d[None, :], mask=s_ok[:, None] & (offs_d[None, :] < dim),
                    other=0.0)
        res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        row = tl.load(q_rows + b).to(tl.int64)
        tl.store(out + row * s_ot + h * s_oh + offs_d, res.to(out.dtype.element_ty), mask=offs_d < dim)

    return decode_partial, decode_reduce
