"""LoRA adapters' deltas over a linear's output, for a batch of rows grouped by adapter
(radixserve/models/lora.py): every row rows[i] with i in group g's range [bounds[2g],
bounds[2g+1]) gets y[row] += (A_g x[row]) Bt_g, A_g (r_g, in), Bt_g (r_g, out).

`lora_add` dispatches: the Triton kernel on CUDA (or the interpreter under TRITON_INTERPRET=1),
radixserve_kernels.cpu's native `lora_add_` for a batch of up to NATIVE_MAX_ROWS fp32 rows (fp32 or
bf16 weights),
else `lora_add_ref`, the torch reference: each group's shrink and expand as two matmuls, the rows
gathered and scattered once for all groups (sliced instead where they are one run from `start`).
The Triton kernel stacks the groups' weights (zero-padded to the largest rank), one program per
(row, block of output columns), the shrink recomputed by each block (a rank-r dot of one row:
cheap next to reading Bt's block).
"""

from __future__ import annotations

import torch

from radixserve_kernels import cpu
from radixserve_kernels._triton import built, next_pow2, use_triton

NATIVE_MAX_ROWS = 64  # a batch of decodes (and drafts); a prefill chunk's deltas are GEMMs (MKL's) work


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, bounds: list[int], a: list[torch.Tensor],
             bt: list[torch.Tensor], cols: list[torch.Tensor], start: int | None = None) -> None:
    """Dispatcher. `cols`: each group's (r, 2) output columns of each rank row of Bt (the native
    kernel reads only those); `start`: rows are start, start + 1, ... (None: scattered)."""
    if use_triton(x):
        lora_add_triton(y, x.contiguous(), rows, bounds, a, bt)
    elif ((ops := cpu.native_for(x, y)) is not None and x.shape[0] <= NATIVE_MAX_ROWS
          and x.dtype == y.dtype == torch.float32 and a[0].dtype in (torch.float32, torch.bfloat16)):
        ops.lora_add_(y, x.contiguous(), rows, bounds, a, bt, cols)
    else:
        lora_add_ref(y, x, rows, bounds, a, bt, start)


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, bounds: list[int], a: list[torch.Tensor],
                 bt: list[torch.Tensor], start: int | None = None) -> None:
    xs = x[start:] if start is not None else x.index_select(0, rows)
    delta = torch.zeros(rows.shape[0], y.shape[1], dtype=y.dtype, device=y.device) if start is None else None
    for g, (wa, wb) in enumerate(zip(a, bt)):
        lo, hi = bounds[2 * g], bounds[2 * g + 1]
        dt = torch.promote_types(xs.dtype, wa.dtype)  # fp32 rows over bf16 weights: in fp32
        h = xs[lo:hi].to(dt) @ wa.t().to(dt)
        if start is not None and y.dtype == dt:  # a prefill's run of rows: the expand adds into y in place (no temporary)
            y[start + lo : start + hi].addmm_(h, wb.to(dt))
            continue
        d = (h @ wb.to(dt)).to(y.dtype)
        if delta is not None:
            delta[lo:hi] = d
        else:
            assert start is not None
            y[start + lo : start + hi] += d
    if delta is not None:
        y.index_add_(0, rows, delta)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, bounds: list[int], a: list[torch.Tensor],
                    bt: list[torch.Tensor]) -> None:
    groups = len(a)
    r = max(w.shape[0] for w in a)
    a_all = torch.zeros(groups, r, x.shape[1], dtype=a[0].dtype, device=x.device)
    b_all = torch.zeros(groups, r, y.shape[1], dtype=bt[0].dtype, device=x.device)
    group_of = torch.empty(rows.shape[0], dtype=torch.int32, device=x.device)
    items: list[int] = []
    for g, (wa, wb) in enumerate(zip(a, bt)):
        a_all[g, : wa.shape[0]] = wa
        b_all[g, : wb.shape[0]] = wb
        group_of[bounds[2 * g] : bounds[2 * g + 1]] = g
        items.extend(range(bounds[2 * g], bounds[2 * g + 1]))
    if not items:
        return
    which = torch.tensor(items, dtype=torch.int64, device=x.device)
    rows_of, groups_of = rows.index_select(0, which).contiguous(), group_of.index_select(0, which).contiguous()
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    n_in, n_out = x.shape[1], y.shape[1]
    block_k, block_n, block_r = min(next_pow2(n_in), 128), min(next_pow2(n_out), 128), next_pow2(r)
    kernel = built("lora_add", _build)
    grid = (len(items), (n_out + block_n - 1) // block_n)
    kernel[grid](y, x, rows_of, groups_of, a_all, b_all, n_in, n_out, r, x.stride(0), y.stride(0),
                 BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_R=block_r)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def lora_add_kernel(y, x, rows, groups, a, b, n_in, n_out, r, sx, sy,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        i = tl.program_id(0)
        nb = tl.program_id(1)
        row = tl.load(rows + i).to(tl.int64)
        g = tl.load(groups + i).to(tl.int64)
        ks = tl.arange(0, BLOCK_R)
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):  # h = A_g x[row]
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x + row * sx + cols, mask=cols < n_in, other=0.0).to(tl.float32)
            av = tl.load(a + g * r * n_in + ks[:, None] * n_in + cols[None, :],
                         mask=(ks[:, None] < r) & (cols[None, :] < n_in), other=0.0).to(tl.float32)
            h += tl.sum(av * xv[None, :], axis=1)
        outs = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        bv = tl.load(b + g * r * n_out + ks[:, None] * n_out + outs[None, :],
                     mask=(ks[:, None] < r) & (outs[None, :] < n_out), other=0.0).to(tl.float32)
        delta = tl.sum(bv * h[:, None], axis=0)
        ptr = y + row * sy + outs
        old = tl.load(ptr, mask=outs < n_out, other=0.0)
        tl.store(ptr, (old.to(tl.float32) + delta).to(old.dtype), mask=outs < n_out)

    return lora_add_kernel
