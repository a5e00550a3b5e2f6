"""A mixture of experts' MLP on the GPU in two grouped GEMMs: the path of `models.moe.MoE` for
float experts on CUDA, with its torch reference (`models.moe.grouped_experts`).

    x        (M, hidden) float
    w13      (E, 2 * inter, hidden): each expert's gate rows then its up rows
    w2       (E, hidden, inter)
    weights  (M, k) fp32 routing weights; experts (M, k) int64 chosen experts (-1: none, another
             rank's under --expert-parallel)

The (token, k) pairs are sorted by expert and each expert's run padded to a whole tile of
BLOCK_M pairs (`align`: torch ops on the device), so every program multiplies one tile of rows
that all chose the same expert by one BLOCK_N slice of that expert's weights: an expert no
row chose is never read, and a tile never mixes experts. The first GEMM gathers each pair's
token row of x (gate_up), the second takes the pair's activation row and scales its output by
the pair's routing weight (down); the k outputs of a token are then summed. This is the shape
of vLLM's and SGLang's fused_moe (sorted, padded pair ids and a per-tile expert), written here
from that description. On CPU it runs only under TRITON_INTERPRET=1 (how CI tests it); it has
not been timed on a GPU (none was lent while it was written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve_kernels._triton import built, interpreting

BLOCK_M = 16  # pairs per tile (tl.dot's least)


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids, tile experts): the flat (token, k) pair indices grouped by expert, each group
    padded with the sentinel experts.numel() to a multiple of block_m, and the expert of each
    tile of block_m ids. Pairs of expert -1 are left out."""
    flat = experts.reshape(-1)
    pairs, device = flat.numel(), flat.device
    live = flat >= 0
    counts = torch.bincount(flat[live], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(torch.where(live, flat, num_experts), stable=True)[: int(live.sum())]
    chosen = flat[order]
    rank = torch.arange(order.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[chosen]
    ids = torch.full((int(padded.sum()),), pairs, dtype=torch.int64, device=device)
    ids[starts[chosen] + rank] = order
    return ids, torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_m)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), (M, hidden) in x's dtype."""
    m, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, experts.shape[1]
    pairs = m * top_k
    ids, tile_expert = align(experts, num_experts)
    out_h = torch.zeros(pairs, two_inter, dtype=torch.float32, device=x.device)  # (a pair of no expert: zeros)
    out_y = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if ids.numel():
        x = x.contiguous()
        _gemm(x, w13, out_h, ids, tile_expert, weights, pairs, top_k, per_token=True)
        act = (F.silu(out_h[:, :inter]) * out_h[:, inter:]).to(x.dtype)
        _gemm(act, w2, out_y, ids, tile_expert, weights.reshape(-1).float().contiguous(), pairs, top_k, per_token=False)
    return out_y.view(m, top_k, hidden).sum(1).to(x.dtype)


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, ids: torch.Tensor, tile_expert: torch.Tensor,
          weights: torch.Tensor, pairs: int, top_k: int, per_token: bool) -> None:
    """c[pair] = a[row] @ w[expert]^T for every live pair, row = pair // top_k (per_token: x's
    token rows) or the pair itself (scaled by its routing weight)."""
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    block_k = 64 if k >= 64 else 32 if k >= 32 else 16
    grid = (ids.numel() // BLOCK_M, -(-n // block_n))
    _kernel()[grid](a, w, c, ids, tile_expert, weights, n, k, pairs, a.stride(0), w.stride(0), w.stride(1), w.stride(2),
                    c.stride(0), TOP_K=top_k, PER_TOKEN=per_token, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                    PRECISE=a.dtype == torch.float32 or interpreting())


def _kernel():
    def build():
        import triton
        import triton.language as tl

        @triton.jit
        def moe_gemm_kernel(a, w, c, ids, tile_expert, weights, N, K, PAIRS, s_am, s_we, s_wn, s_wk, s_cm,
                            TOP_K: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRECISE: tl.constexpr):
            tile, pid_n = tl.program_id(0), tl.program_id(1)
            pair = tl.load(ids + tile * BLOCK_M + tl.arange(0, BLOCK_M))
            live = pair < PAIRS
            row = pair // TOP_K if PER_TOKEN else pair
            expert = tl.load(tile_expert + tile).to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            kk = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + kk
                at = tl.load(a + row[:, None] * s_am + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
                wt = tl.load(w + expert * s_we + cols[None, :] * s_wn + ks[:, None] * s_wk,
                             mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # (BLOCK_K, BLOCK_N)
                if PRECISE:
                    acc += tl.dot(at.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(at, wt.to(at.dtype))
            if not PER_TOKEN:
                acc *= tl.load(weights + pair, mask=live, other=0.0)[:, None]
            tl.store(c + pair[:, None] * s_cm + cols[None, :], acc, mask=live[:, None] & (cols[None, :] < N))

        return moe_gemm_kernel

    return built("fused_moe", build)
