"""CPU matmuls at this CPU's roofs: each linear picks its kernel by the number of rows it gets.

Measured on the reference machine (2 Xeon cores, AVX512-BF16, no AMX; SmolLM2's 30 layers of
linears and its head on one row, each weight distinct so it streams from memory;
`.venv/bin/python scripts/linear_roofs.py`, one run, ms):

    rows | bf16 plain | bf16 oneDNN-packed | bf16 native | fp32 plain | fp32 oneDNN-packed | fp32 native
    1    |    26.1    |        18.9        |    13.2     |    21.5    |        26.3        |    20.6
    32   |    64.6    |        56.8        |    56.4     |    63.4    |        52.6        |    52.0
    1024 |   1358.6   |      1309.1        |      -      |   759.4    |       782.6        |      -

"native" is radixserve's own kernel (kernels/radixserve_kernels/cpu.py `linear`: weights packed once into panels
of 64 outputs, `vdpbf16ps` for bf16, FMA for fp32, the weight stream prefetched). At one row
it streams the weights near the memory's rate (270 MB in 13.2 ms bf16, 540 MB in 20.6 ms
fp32: ~20 and ~26 GB/s; this machine's timings vary by 10-20 % from run to run); at 32 rows
it matches oneDNN (both compute-bound). So decode
batches (up to 64 rows) run on weights packed for the native kernel where it is built
(oneDNN's packing elsewhere: bf16 from one row, fp32 from two, where torch's plain sgemv
wins at one), and prefill chunks (many rows) of a bf16 model run in fp32 on the fly (weights
upcast one layer at a time: MKL's sgemm beats oneDNN's bf16 GEMM on this CPU by 1.7x). The
plain weight stays (the embedding ties to it, and the prefill path reads it); the packed copy
is extra memory: one more copy of the linear weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels import cpu

log = logging.getLogger(__name__)

PACK_HINT = 32  # the batch size oneDNN lays the packed weights out for (fine from 1 to 64 rows)
PACKED_MAX_ROWS = 64  # more rows: a prefill chunk
UPCAST_MIN_ROWS = 128  # bf16 prefill chunks from this many rows run in fp32


class PackedLinear(nn.Module):
    """nn.Linear's math with the kernel chosen per call (see the module docstring)."""

    def __init__(self, linear: nn.Linear, float_out: bool = False) -> None:
        """float_out: return fp32 whatever the weights are (a head's logits: the native kernel
        stores its fp32 sums instead of rounding them to bf16 and widening them again)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared: a tied embedding stays tied
        self.bias = linear.bias
        self.float_out = float_out
        w = linear.weight.detach()
        ops = cpu.native_for(w)
        self.native = ops if ops is not None and ops.linear_supports(w) else None
        # fp32 at one row without the native kernel: torch's plain sgemv beats oneDNN's packed one
        self.packed_from = 1 if self.native is not None or w.dtype == torch.bfloat16 else 2
        packed = self.native.pack_linear(w) if self.native else torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)
        self.register_buffer("packed", packed, persistent=False)
        # the native kernel adds the bias in fp32: converted once here, not per call
        self.native_bias = linear.bias.detach().float() if self.native and linear.bias is not None else None
        self.upcast = w.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed_from <= rows <= PACKED_MAX_ROWS:
            if self.native is not None:
                return self.native.linear(x, self.packed, self.out_features, self.native_bias, self.float_out)
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.upcast and rows >= UPCAST_MIN_ROWS:
            b = self.bias.float() if self.bias is not None else None
            y = F.linear(x.float(), self.weight.float(), b)
            return y if self.float_out else y.to(x.dtype)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.float() if self.float_out else y


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


@torch.no_grad()
def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear (CPU, fp32/bf16); returns how many."""
    if not packing_available(dtype, device):
        return 0
    try:  # an oneDNN build without the op: keep plain linears
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype),
                                           torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1),
                                           None, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        log.warning("oneDNN packed linears are not available (%r); using plain ones", e)
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dim() == 2:
                setattr(parent, name, PackedLinear(child, float_out=name == "lm_head"))  # the head's logits are fp32
                n += 1
    return n
