"""Apply a token bitmask to logits in place: disallowed tokens get -inf.

Layout (xgrammar's): int32 `(batch, ceil(vocab / 32))`; bit j of word w allows token
32 * w + j. Only the rows listed in `rows` are masked (the constrained rows of a mixed
batch); row i of `mask` belongs to logits row rows[i]. Logits columns past the mask's
vocabulary (padded embeddings) are disallowed in masked rows.
"""

from __future__ import annotations

import os

import torch


def apply_bitmask_ref(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """The torch reference: unpack the bits and fill -inf where a bit is clear."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask[:, :, None] >> bits) & 1).bool().flatten(1)  # (n, words * 32)
    width = min(vocab, allowed.shape[1])
    full = torch.zeros(mask.shape[0], vocab, dtype=torch.bool, device=logits.device)
    full[:, :width] = allowed[:, :width]
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~full, float("-inf"))
    logits.index_copy_(0, rows, sub)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Dispatcher: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), torch elsewhere."""
    if rows.numel() == 0:
        return
    if logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        apply_bitmask_triton(logits, mask, rows)
    else:
        apply_bitmask_ref(logits, mask, rows)


def apply_bitmask_triton(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, block: int = 1024) -> None:
    import triton

    kernel = _kernel()
    n, vocab = rows.numel(), logits.shape[1]
    grid = (n, triton.cdiv(vocab, block))
    kernel[grid](logits, mask, rows, vocab, mask.shape[1], logits.stride(0), mask.stride(0), BLOCK=block)


_KERNEL = None


def _kernel():
    """Build the @triton.jit kernel on first use (importing triton is not free)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def bitmask_kernel(logits, mask, rows, vocab, words, logits_stride, mask_stride, BLOCK: tl.constexpr):
            i = tl.program_id(0)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            row = tl.load(rows + i)
            in_vocab = cols < vocab
            word = tl.load(mask + i * mask_stride + cols // 32, mask=in_vocab & (cols // 32 < words), other=0)
            allowed = ((word >> (cols % 32)) & 1) == 1
            ptr = logits + row * logits_stride + cols
            tl.store(ptr, tl.full((BLOCK,), float("-inf"), tl.float32).to(logits.dtype.element_ty), mask=in_vocab & ~allowed)

        _KERNEL = bitmask_kernel
    return _KERNEL
