"""y = x W^T over a quantized weight in radixserve's packed blocks (radixserve/models/quant.py):
the GPU path of `QuantLinear`, with its torch reference.

    x        (M, K) float
    packed   (ceil(N/16), ceil(K/32), 320 | 544) uint8: per panel of 16 outputs and block of 32
             inputs, 4-bit weights (256 bytes of nibbles, 16 fp16 d, 16 fp16 m: w = d*q + m) or
             8-bit ones (512 bytes of q + 128, 16 fp16 d: w = d*q); dequant_ref also reads
             MXFP4's 336-byte records (the 4-bit ones, each nibble an index into FP4_LUT)

Each program dequantizes one panel's blocks in registers (weights stay 4.5 or 8.5 bits in
memory: the whole point) and multiplies a tile of up to BLOCK_M rows with `tl.dot`, fp32
accumulation. The CPU runs its own native kernel instead (kernels/radixserve_kernels/cpu.py `qlinear`); here the
Triton kernel runs on CUDA, and on CPU only under TRITON_INTERPRET=1 (how CI tests it). It has
not been timed on a GPU (none was lent while it was written): one 16-output panel per program
is simple, not tuned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve_kernels._triton import built, interpreting, next_pow2

FP4_LUT = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0])  # quant_linear.cpp's


def dequant_ref(packed: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The packed weight's fp32 rows in torch (any device): the reference `dequant_quant` is
    tested against, and the path where the native kernels are not built."""
    panels, kb, nbytes = packed.shape
    if rows is None:
        rows = torch.arange(n, device=packed.device)
    blk = packed[rows // 16]  # (r, kb, bytes)
    lane = (rows % 16).view(-1, 1)
    half = lambda off: blk[:, :, off:off + 32].contiguous().view(torch.float16).float()  # noqa: E731
    take = lambda scales: scales.gather(2, lane.view(-1, 1, 1).expand(-1, kb, 1))  # noqa: E731
    j = torch.arange(32, device=packed.device)
    if nbytes == 544:  # 8-bit: byte 64c + 4n + r holds weight 4c + r
        at = (j // 4) * 64 + j % 4
        q = blk.gather(2, (at.view(1, 1, -1) + 4 * lane.view(-1, 1, 1)).expand(-1, kb, -1)).float() - 128
        w = take(half(512)) * q
    else:  # 4-bit: weight j < 16 in the low nibble of byte 64(j/4) + 4n + j%4, j >= 16 in the high one
        jj = j % 16
        at = (jj // 4) * 64 + jj % 4
        byte = blk.gather(2, (at.view(1, 1, -1) + 4 * lane.view(-1, 1, 1)).expand(-1, kb, -1)).int()
        q = torch.where(j < 16, byte & 0xF, byte >> 4)
        if nbytes == 336:  # MXFP4: each nibble stands for an e2m1 value (doubled, plus 12)
            q = FP4_LUT.to(packed.device)[q]
        w = take(half(256)) * q.float() + take(half(288))
    return w.reshape(len(rows), kb * 32)[:, :k]


def quant_matmul_ref(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: dequantize, then F.linear in fp32."""
    return F.linear(x.float(), dequant_ref(packed, n, x.shape[1]), None if bias is None else bias.float())


def quant_matmul_triton(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, n) fp32."""
    m, k = x.shape
    panels, kb, nbytes = packed.shape
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and nbytes in (320, 544) and kb * 32 >= k and panels * 16 >= n
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m = min(64, max(16, next_pow2(m)))
    kernel = _kernel()
    kernel[(triton_cdiv(m, block_m), panels)](
        x, packed, y, bias if bias is not None else y, m, n, k, kb, x.stride(0),
        BITS=4 if nbytes == 320 else 8, HAS_BIAS=bias is not None, BLOCK_M=block_m, PRECISE=x.dtype == torch.float32 or interpreting())
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel():
    def build():
        import triton
        import triton.language as tl

        @triton.jit
        def quant_matmul_kernel(x, packed, y, bias, M, N, K, KB, s_xm, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BLOCK_M: tl.constexpr, PRECISE: tl.constexpr):
            pid_m, panel = tl.program_id(0), tl.program_id(1)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            lane = tl.arange(0, 16)
            kk = tl.arange(0, 32)
            nbytes = 320 if BITS == 4 else 544
            acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
            for b in range(0, KB):
                base = (panel.to(tl.int64) * KB + b) * nbytes
                cols = b * 32 + kk
                xt = tl.load(x + rows[:, None] * s_xm + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
                if BITS == 4:  # weight k of output n: byte 64*((k%16)//4) + 4n + k%4, high nibble for k >= 16
                    at = 64 * ((kk % 16) // 4)[:, None] + 4 * lane[None, :] + (kk % 4)[:, None]
                    byte = tl.load(packed + base + at).to(tl.int32)
                    q = tl.where(kk[:, None] < 16, byte & 15, byte >> 4).to(tl.float32)
                    d = tl.load((packed + base + 256).to(tl.pointer_type(tl.float16)) + lane).to(tl.float32)
                    mm = tl.load((packed + base + 288).to(tl.pointer_type(tl.float16)) + lane).to(tl.float32)
                    w = q * d[None, :] + mm[None, :]  # (32, 16)
                else:  # byte 64*(k//4) + 4n + k%4 holds q + 128
                    at = 64 * (kk // 4)[:, None] + 4 * lane[None, :] + (kk % 4)[:, None]
                    q = tl.load(packed + base + at).to(tl.int32) - 128
                    d = tl.load((packed + base + 512).to(tl.pointer_type(tl.float16)) + lane).to(tl.float32)
                    w = q.to(tl.float32) * d[None, :]
                if PRECISE:
                    acc += tl.dot(xt.to(tl.float32), w, input_precision="ieee")
                else:
                    acc += tl.dot(xt, w.to(xt.dtype))
            outs = panel * 16 + lane
            if HAS_BIAS:
                acc += tl.load(bias + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y + rows[:, None] * N + outs[None, :], acc, mask=(rows[:, None] < M) & (outs[None, :] < N))

        return quant_matmul_kernel

    return built("quant_matmul", build)
