"""The @triton.jit code of the paged-attention kernels (decode_attention, extend_attention).

Imported only when a kernel is first built: importing triton is not free, and `triton.jit`
decides at decoration whether a function runs compiled or in the interpreter
(TRITON_INTERPRET=1), which is fixed per process anyway (triton's own library functions are
built when triton is first imported).
"""

import triton
import triton.language as tl


@triton.jit
def _attend(qv, row_table, offs_n, n_ok, visible, k_pool, v_pool, s_ks, s_kh, s_vs, s_vh, kh, offs_d, d_ok, scale, m, denom,
            acc, PRECISE: tl.constexpr):
    """One block of K/V rows, loaded through a request's slot table, scored against the
    queries (`visible`: what each query may see) and folded into the online softmax (running
    max `m`, denominator, unnormalized output). Returns the new (m, denom, acc). The first
    block a caller passes shows every query row at least one key, so `m` stays finite."""
    slot = tl.load(row_table + offs_n, mask=n_ok, other=0).to(tl.int64)
    kv_ok = n_ok[:, None] & d_ok[None, :]
    kt = tl.load(k_pool + slot[:, None] * s_ks + kh * s_kh + offs_d[None, :], mask=kv_ok, other=0.0)
    vt = tl.load(v_pool + slot[:, None] * s_vs + kh * s_vh + offs_d[None, :], mask=kv_ok, other=0.0)
    if PRECISE:
        s = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(qv, tl.trans(kt))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    if PRECISE:
        pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


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
    row_table = table + b.to(tl.int64) * s_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        m, denom, acc = _attend(qv, row_table, offs_n, n_ok, n_ok[None, :], k_pool, v_pool, s_ks, s_kh, s_vs, s_vh, kh, offs_d,
                                d_ok, scale, m, denom, acc, PRECISE)
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
    row_table = table + i.to(tl.int64) * s_tb
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])  # key 0 is visible to every row
        m, denom, acc = _attend(qv, row_table, offs_n, n_ok, visible, k_pool, v_pool, s_ks, s_kh, s_vs, s_vh, kh, offs_d, d_ok,
                                scale, m, denom, acc, PRECISE)
    res = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + (q_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :], res.to(out.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
