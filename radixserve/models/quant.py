"""Quantized weights: GGUF's quantized blocks served as they are (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K), and int8 / int4 quantization of float checkpoints at load time.

A weight stays in its file's blocks, repacked once by `radixserve_kernels.cpu` pack_quant into panels of
16 outputs (one record per panel and GGUF block, at the file's size or within 3 % of it):

    q4_1   w = d*q + m, q in 0..15          GGUF Q4_1; `--quantization int4` (min/max per block)
    q4_0   w = d*(q - 8)                    GGUF Q4_0 (stored as q4_1 with m = -8d, exactly)
    q8_0   w = d*q, q in -127..127          GGUF Q8_0; `--quantization int8` (one d per output
                                            row: per-channel, held in every block of the row)
    q5_0   w = d*(q - 16), q in 0..31       GGUF Q5_0 (blocks of 32)
    q5_1   w = d*q + m, q in 0..31          GGUF Q5_1
    q4_k   w = (d*sc)*q - dmin*mn           GGUF Q4_K: super-blocks of 256, 6-bit sc/mn per 32
    q5_k   the same, q in 0..31             GGUF Q5_K
    q6_k   w = (d*sc)*(q - 32), q in 0..63  GGUF Q6_K: an int8 sc per 16 weights

The repack keeps the file's bits, so dequantizing reproduces gguf-py's float weights bit for
bit (tests/test_quant.py, every kind). How a `QuantLinear` computes, by the rows it gets:

    few rows (decode, <= 64)  the native kernel quantizes each row's activations per block of 32
                              to 8 bits (`--activations int8`, the default, llama.cpp's Q8_0
                              form) or 16 (`int16`: two int8 halves, twice the integer work) and
                              sums u8 x s8 products in integers (vpdpbusd with AVX512-VNNI,
                              vpmaddubsw + vpmaddwd with AVX2: the same sums, so the same
                              numbers); `float` dequantizes the weight at each call and runs an
                              fp32 GEMM instead (exact, slow). `radixserve bench quality`
                              measures each choice against the exact model
    32 rows or more, on a CPU with AMX-INT8 (Sapphire Rapids and later): the same integer sums on
                              the AMX tiles (16 rows x 16 outputs x 32 weights per tdpbsud),
                              scaled as the VNNI tiles do, so the same numbers bit for bit
                              (kernels/radixserve_kernels/csrc/amx.h; 1.1-1.3x the VNNI tiles)
    many rows (prefill)       the same native kernel, 128 rows a pass, where it outruns
                              dequantize + fp32 GEMM (`QuantLinear.native_prefill`: with VNNI,
                              ~160-270 GMAC/s at 8 bits and 120-170 at 16 against MKL's ~55; on
                              AVX2 at 8 bits, 85-125); else (AVX2 at 16 bits) the weight is
                              dequantized once per call and multiplied in fp32, exactly the
                              dequantized model's numbers. NATIVE_PREFILL (or
                              RADIXSERVE_QUANT_PREFILL=native|dequant) overrides the choice
    on CUDA                   kernels/radixserve_kernels/quant_matmul.py: a Triton kernel dequantizing in registers
                              (Q4_0 / Q4_1 / Q8_0; the other kinds load dequantized on a GPU)
    no kernels at all         (RADIXSERVE_CPU_KERNELS=0) dequantized in torch (`dequant_ref`)
                              per call: correct, not fast

Why not torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` (or torchao around
them): their group scales are in the activation dtype (bf16 would round GGUF's fp16 scales),
they have no Q8_0-with-blocks form, and measured here on SmolLM2's 30 layers at one row
they took 1.6 ms (bf16) and 18-34 ms (fp32) against this kernel's ~2.3 ms in either dtype,
which also runs Q8_0 (the tied embedding/head) and batches of 32 at ~2x bf16's speed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels import cpu
from radixserve_kernels._triton import use_triton
from radixserve_kernels.quant_matmul import dequant_ref, quant_matmul_triton

BLOCK = 32
PANEL = 16
MAX_NATIVE_ROWS = 64  # rows the native kernel always takes; more rows (prefill): see NATIVE_PREFILL
ACTIVATIONS = {"auto": 8, "int8": 8, "int16": 16, "float": 0}  # --activations -> QuantLinear.act_bits (0: float)
# `auto` keeps a head of these kinds at 16 bits. The logits' error is the head weights' rounding
# plus the activations': 8-bit weights round as finely as 8-bit activations, so 16 bits halve the
# head's error (SmolLM2's Q8_0 head: mean KLD 0.00296 -> 0.00211); a head of 6 bits or fewer
# (Qwen2.5's Q6_K) rounds 4x+ coarser, its activations' share is within the error (0.00125 against
# 0.00120 +- 0.00006), and 16 bits would cost twice the integer work where a batch's rows all
# sample (docs/quantization.md)
WIDE_HEAD_KINDS = frozenset({"q8_0"})
# prefill through the native kernel (True), through dequantize + fp32 GEMM (False), or (None) as
# QuantLinear.native_prefill says; read at each call
NATIVE_PREFILL: bool | None = {"native": True, "dequant": False}.get(os.environ.get("RADIXSERVE_QUANT_PREFILL", "auto"))
# kind -> (weights per GGUF block, bytes per packed record: one panel of 16 outputs x one block)
FORMATS = {"q4_0": (32, 320), "q4_1": (32, 320), "q8_0": (32, 544), "mxfp4": (32, 336), "q5_0": (32, 352), "q5_1": (32, 384),
           "q4_k": (256, 2368), "q5_k": (256, 2880), "q6_k": (256, 3360)}
TRITON_KINDS = ("q4_0", "q4_1", "q8_0")  # what kernels/radixserve_kernels/quant_matmul.py runs on a GPU


@dataclass
class QuantTensor:
    """A quantized 2-d weight (n, k) in GGUF blocks: `raw` is (n, blocks * block bytes) uint8.
    `release`, if given, hands the bytes `raw` views back (a file's mapped pages) once packed."""

    kind: str
    raw: torch.Tensor
    n: int
    k: int
    release: Callable[[], None] | None = None

    def rows(self, index: torch.Tensor) -> QuantTensor:
        return QuantTensor(self.kind, self.raw.index_select(0, index), self.n, self.k, self.release)

    def done(self) -> None:
        """Packed: its source bytes may go."""
        if self.release is not None:
            self.release()

    def dequantize(self) -> torch.Tensor:
        """fp32 (n, k), by gguf-py (what dequant_quant reproduces)."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(self.raw.numpy(), GGMLQuantizationType[self.kind.upper()])
        return torch.from_numpy(values.reshape(self.n, -1)[:, : self.k].copy())


def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Stack weights of one kind along the output dimension (q/k/v into qkv, gate/up)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or len({p.k for p in parts}) != 1:
        raise ValueError(f"cannot fuse quantized weights of kinds {sorted(kinds)}")
    return QuantTensor(parts[0].kind, torch.cat([p.raw for p in parts]), sum(p.n for p in parts), parts[0].k,
                       lambda: _done_all(parts))


def _done_all(parts: list[QuantTensor]) -> None:
    for p in parts:
        p.done()


def packed_shape(kind: str, n: int, k: int) -> tuple[int, int, int]:
    """The shape pack_quant gives an (n, k) weight of this kind: (panels, blocks, record bytes)."""
    block, record = FORMATS[kind]
    return (n + PANEL - 1) // PANEL, (k + block - 1) // block, record


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as the OCP checkpoints store it (gpt-oss's safetensors: `blocks` (rows, k/32, 16)
    bytes holding elements 2i and 2i+1 in their low and high nibbles, `scales` (rows, k/32) E8M0
    bytes) as GGUF's MXFP4 blocks (rows, k/32 * 17): the scale byte, then 16 bytes holding
    elements j and j + 16. The same values bit for bit (both are e2m1 codes times 2^(e - 127))."""
    rows, kb, _ = blocks.shape
    codes = torch.stack([blocks & 0xF, blocks >> 4], -1).reshape(rows, kb, 32)  # elements in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.reshape(rows, kb, 1), packed], -1).reshape(rows, kb * 17).contiguous()


def packable(q: QuantTensor) -> bool:
    """Whether pack_quant holds q exactly: an MXFP4 tensor's block scales 2^(e - 128) in fp16's
    exact range (104 <= e <= 140; a block of zeros takes any), else it loads dequantized."""
    if q.kind != "mxfp4":
        return True
    blocks = q.raw.view(q.n, -1, 17)
    e, nibbles = blocks[..., 0], blocks[..., 1:]
    zeros = ((nibbles & 0x77) == 0).all(-1)
    return bool((((e >= 104) & (e <= 140)) | zeros).all())


def pack(q: QuantTensor) -> torch.Tensor:
    ops = cpu.ops()
    if ops is None:
        raise RuntimeError("packing quantized weights needs radixserve's CPU kernels (kernels/radixserve_kernels/cpu.py)")
    return ops.pack_quant(q.raw, q.kind, q.n, q.k)


# -- quantizing float weights (--quantization int8 / int4) ----------------------------------
def _padded(w: torch.Tensor) -> torch.Tensor:
    k = w.shape[1]
    return F.pad(w.float(), (0, (-k) % BLOCK))


def quantize_int4(w: torch.Tensor) -> QuantTensor:
    """Group-wise asymmetric int4 (groups of 32): GGUF's Q4_1, d = (max - min)/15, m = min."""
    n, k = w.shape
    blocks = _padded(w).view(n, -1, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((blocks - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low nibble), j + 16 (high)
    raw = torch.cat([d.view(torch.uint8).view(n, -1, 2), m.view(torch.uint8).view(n, -1, 2), qs], -1)
    return QuantTensor("q4_1", raw.reshape(n, -1).contiguous(), n, blocks.shape[1] * BLOCK)


def quantize_int8(w: torch.Tensor) -> QuantTensor:
    """Per-channel symmetric int8: one scale amax/127 per output row (in each of its blocks)."""
    n, k = w.shape
    blocks = _padded(w).view(n, -1, BLOCK)
    d = (w.float().abs().amax(1) / 127).half()  # (n,)
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(n))
    q = (blocks * inv[:, None, None]).round().clamp(-127, 127).to(torch.int8)
    dd = d.view(torch.uint8).view(n, 1, 2).expand(n, blocks.shape[1], 2)
    raw = torch.cat([dd, q.view(torch.uint8)], -1)
    return QuantTensor("q8_0", raw.reshape(n, -1).contiguous(), n, blocks.shape[1] * BLOCK)


QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8}


# -- modules ---------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """nn.Linear's interface over a packed quantized weight (see the module docstring)."""

    packed: torch.Tensor
    native: Any

    def __init__(self, n: int, k: int, kind: str, bias: bool, float_out: bool = False,
                 packed: torch.Tensor | None = None) -> None:
        """packed: share another module's weight (a head tied to a quantized embedding)."""
        super().__init__()
        self.in_features, self.out_features, self.kind = k, n, kind
        self.float_out = float_out
        if packed is None:
            packed = torch.empty(packed_shape(kind, n, k), dtype=torch.uint8)
        self.register_buffer("packed", packed)
        self.bias = nn.Parameter(torch.empty(n)) if bias else None
        self.native = None  # the kernels, once `finish` found them for this device
        self.vnni = False  # their build sums with VNNI (then prefill runs on them too)
        self.int_tiles = False  # their build has vector integer tiles (not the portable build)
        self.native_bias: torch.Tensor | None = None
        self.act_bits = 8  # the native kernel's activations: 8 or 16 bits per value; 0: dequantize, fp32 GEMM

    def finish(self) -> None:
        """After the weights are in: pick the kernels and convert the bias once."""
        self.native = cpu.ops() if self.packed.device.type == "cpu" else None
        self.vnni = self.native is not None and "vnni" in self.native.isa()
        self.int_tiles = self.native is not None and not self.native.isa().startswith("generic")
        if self.native is not None and self.bias is not None:
            self.native_bias = self.bias.detach().float().contiguous()

    @property
    def native_prefill(self) -> bool:
        """Whether prefill (more rows than one call takes) runs the integer kernel (in passes of 128 rows):
        where it outruns dequantize + fp32 GEMM (MKL's ~55 GMAC/s here): with VNNI at either
        width, and on AVX2 at 8 bits (85-125 GMAC/s at 32-64 rows; 16 bits there: 40-80); never
        on the portable build (scalar loops). `scripts/quant_roofs.py` measures it."""
        return self.vnni or (self.int_tiles and self.act_bits == 8)

    def native_rows(self, rows: int) -> bool:
        """Whether `rows` rows run on the native integer kernel (else dequantize + fp32 GEMM)."""
        return (self.native is not None and bool(self.act_bits) and self.packed.device.type == "cpu"
                and (rows <= MAX_NATIVE_ROWS or (NATIVE_PREFILL if NATIVE_PREFILL is not None else self.native_prefill)))

    def dequantized(self) -> torch.Tensor:
        return dequantize_packed(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if self.native_rows(rows) and x2.dtype in (torch.float32, torch.bfloat16) \
                and not (torch.is_grad_enabled() and x2.requires_grad):
            # prefill too: one call, which the kernel takes 128 rows a pass (csrc/quant.h QLINEAR_ROWS)
            y = self.native.qlinear(x2.contiguous(), self.packed, self.out_features, self.native_bias, self.float_out, False,
                                    self.act_bits)
        elif self.native is None and use_triton(x2):  # CUDA: kernels/radixserve_kernels/quant_matmul.py
            y = quant_matmul_triton(x2, self.packed, self.out_features, self.bias)
            y = y if self.float_out else y.to(x.dtype)
        else:
            b = self.bias.float() if self.bias is not None else None
            y = F.linear(x2.float(), self.dequantized(), b)
            y = y if self.float_out else y.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, act_bits={self.act_bits}"


class SplitQuantLinear(nn.Module):
    """A fused linear (q/k/v, gate/up) whose parts are quantized in different kinds (a Q4_K_M file
    keeps v in Q6_K beside q and k in Q4_K): each part runs on its own blocks, the outputs are
    concatenated. Once the weights are in (`finish`), each part adds its slice of the bias inside
    its kernel, in fp32 as a whole QuantLinear does (models.llama.FusedDecode calls the parts)."""

    def __init__(self, parts: list[QuantLinear], bias: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    @property
    def bias_in_parts(self) -> bool:
        return self.bias is not None and self.parts[0].bias is not None

    def finish(self) -> None:
        """After the weights are in, before the parts' own `finish`: each part's bias becomes a
        view of its slice."""
        at = 0
        for p in cast(list[QuantLinear], list(self.parts)):
            if self.bias is not None:
                p.bias = nn.Parameter(self.bias.detach()[at:at + p.out_features], requires_grad=False)
            at += p.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = cast(list[QuantLinear], list(self.parts))
        x2 = x.reshape(-1, x.shape[-1])
        ops, bits, rows = parts[0].native, parts[0].act_bits, x2.shape[0]
        if ((self.bias is None or self.bias_in_parts) and x2.dtype in (torch.float32, torch.bfloat16)
                and not (torch.is_grad_enabled() and x2.requires_grad)
                and all(p.native is ops and p.native_rows(rows) and p.act_bits == bits and not p.float_out for p in parts)):
            # every part in one native call: x quantized once, one parallel region, written in place
            y = ops.qlinear_parts(x2.contiguous(), [p.packed for p in parts], [p.out_features for p in parts],
                                  [p.bias for p in parts], bits)
            return y.view(*x.shape[:-1], self.out_features)
        y = torch.cat([p(x) for p in parts], dim=-1)
        return y if self.bias is None or self.bias_in_parts else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kinds={[p.kind for p in self.parts]}"


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup dequantizes only the rows it reads."""

    packed: torch.Tensor

    def __init__(self, num: int, dim: int, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.kind, self.dtype = num, dim, kind, dtype
        self.register_buffer("packed", torch.empty(packed_shape(kind, num, dim), dtype=torch.uint8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_packed(self.packed, self.num_embeddings, self.embedding_dim, ids.reshape(-1).long())
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)


def dequantize_packed(packed: torch.Tensor, n: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 rows (all: None) of a packed weight: the native kernel on CPU, torch elsewhere."""
    ops = cpu.ops() if packed.device.type == "cpu" else None
    return ops.dequant_quant(packed, n, k, rows) if ops is not None else dequant_ref(packed, n, k, rows)


def set_activations(model: nn.Module, choice: str) -> str:
    """Set every quantized linear's activations (`--activations`); returns what runs: "int8
    (head int16)" (auto, a head of WIDE_HEAD_KINDS), "int8", "int16" or "float" ("float" too for a model with no quantized
    linear, where `auto` and `float` are the only choices). A choice the linears cannot take is a
    ValueError naming it."""
    if choice not in ACTIVATIONS:
        raise ValueError(f"--activations: one of {', '.join(ACTIVATIONS)}, got {choice!r}")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    bits = ACTIVATIONS[choice]
    if not linears or bits == 0:
        if bits and choice != "auto":
            raise ValueError(f"--activations {choice}: the model has no quantized weights (it applies to GGUF blocks and "
                             "--quantization int8 / int4); use auto or float")
        for m in linears:
            m.act_bits = 0
        return "float"
    if any(m.native is None for m in linears):
        if choice != "auto":
            raise ValueError(f"--activations {choice}: the quantized linears run without radixserve's CPU kernels here "
                             "(CUDA, or the kernels disabled), which take float activations only; use auto or float")
        return "float"
    for m in linears:
        m.act_bits = bits
    head = getattr(model, "lm_head", None)
    if choice == "auto" and isinstance(head, QuantLinear) and head.kind in WIDE_HEAD_KINDS:
        head.act_bits = 16
        return "int8 (head int16)"
    return f"int{bits}"


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's storage: (a key shared by the tensors that share it, its bytes)."""
    try:
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # an opaque (mkldnn) tensor
        return id(t), t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor's storage once (a tied head counts once;
    oneDNN's packed weights have no storage to share and count by their size)."""
    return sum(dict(_storage(t) for t in [*model.parameters(), *model.buffers()]).values())


def unread_embedding_bytes(model: nn.Module) -> int:
    """The bytes of the input embedding that no other weight shares: a decode step reads one row
    of such a table (a head of its own, as Qwen2.5-Coder-1.5B's GGUF has), where a tied head
    reads all of it."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(emb, nn.Module):
        return 0
    inside = {id(m) for m in emb.modules()}  # (a tied head may hold the very same Parameter)
    others = {_storage(t)[0] for m in model.modules() if id(m) not in inside
              for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    return sum(n for key, n in dict(_storage(t) for t in [*emb.parameters(), *emb.buffers()]).items() if key not in others)


def describe(model: nn.Module) -> dict[str, int]:
    """How many linears/embeddings hold each kind of weight."""
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            out[m.kind] = out.get(m.kind, 0) + 1
    return out


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the float linears of a loaded Llama-family model by QuantLinears (`--quantization
    int8 | int4` on a float checkpoint). The head becomes int8 either way, as llama.cpp keeps
    its output tensor at higher precision; a tied embedding then reads the head's int8 rows.
    Returns how many linears were quantized."""
    quantizer = QUANTIZERS[method]
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or getattr(child, "keep_float", False):  # (a MoE's routers)
                continue
            head = name == "lm_head"
            setattr(parent, name, quant_linear(child, quantize_int8 if head else quantizer, float_out=head))
            n += 1
    inner: Any = getattr(model, "model", None)
    tail: Any = getattr(model, "lm_head", None)
    cfg: Any = getattr(model, "cfg", None)
    if cfg is not None and cfg.tie_word_embeddings and isinstance(tail, QuantLinear):
        emb = QuantEmbedding(tail.out_features, tail.in_features, tail.kind, inner.embed_tokens.weight.dtype)
        emb.packed = tail.packed
        inner.embed_tokens = emb
    return n


@torch.no_grad()
def quant_linear(linear: nn.Linear, quantizer: Callable[[torch.Tensor], QuantTensor], float_out: bool = False) -> QuantLinear:
    q = quantizer(linear.weight.detach())
    mod = QuantLinear(linear.out_features, linear.in_features, q.kind, linear.bias is not None, float_out=float_out,
                      packed=pack(q).to(linear.weight.device))
    if linear.bias is not None:
        mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    mod.finish()
    return mod
