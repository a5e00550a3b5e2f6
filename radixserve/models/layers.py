"""Building blocks of the Llama family: RMSNorm, rotary embeddings (default, linear, llama3), MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels import cpu


class RMSNorm(nn.Module):
    """Fused: one kernel (fp32 accumulation) instead of five ops. With a residual,
    `norm(x, residual)` returns (norm(x + residual), x + residual): the add that precedes
    every norm in a decoder layer rides along, in the same kernel on CPU (kernels/radixserve_kernels/cpu.py;
    `F.rms_norm` where that is not built)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        ops = cpu.native_for(x, self.weight)
        if ops is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            outs = ops.rms_norm(x, residual, self.weight, self.eps)
            return outs[0] if residual is None else tuple(outs)
        if residual is not None:
            x = x + residual
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The rotary frequencies. `freq_factors`: a GGUF file's `rope_freqs` (llama.cpp's converter
    writes Llama 3's scaling as one divisor per frequency): they are the llama3 scaling, so a
    config's llama3 entry is not applied again over them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.float().to(inv.device)
        if scaling is not None and scaling["rope_type"] == "llama3":
            scaling = None
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (supported: linear, llama3, yarn)")


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen's long contexts), as transformers computes it: the frequencies that turn
    fewer than beta_slow times over the original context interpolated by `factor`, those that
    turn more than beta_fast times kept, a linear ramp between (the cos/sin scale is `rope_mscale`)."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    at = lambda turns: head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = at(fast), at(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_mscale(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (`attention_factor`, else 0.1 ln(factor) + 1, or the
    ratio of two such with mscale / mscale_all_dim); 1 for every other kind."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    m = lambda scale: 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0  # noqa: E731
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return m(scaling["mscale"]) / m(scaling["mscale_all_dim"])
    return m(1.0)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding over a precomputed cos/sin table."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.args = (head_dim, max_position, theta, scaling)
        self.freq_factors: torch.Tensor | None = None  # a GGUF file's rope_freqs (see rope_inv_freq)
        # one half of rotate-half's table: its two halves are equal (Gemma 3's 32K context, two
        # tables of 256 dims: 67 MiB instead of 134)
        self.register_buffer("cos", torch.empty(max_position, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table in fp32 on the buffers' device (after `to_empty`)."""
        head_dim, max_position, theta, scaling = self.args
        if self.cos.is_meta:
            return
        inv = rope_inv_freq(head_dim, theta, scaling, self.freq_factors).to(self.cos.device)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=inv.device), inv)
        scale = rope_mscale(scaling)
        self.cos = freqs.cos() * scale if scale != 1.0 else freqs.cos()
        self.sin = freqs.sin() * scale if scale != 1.0 else freqs.sin()

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        if tuple(factors.shape) != (self.args[0] // 2,):
            raise ValueError(f"rope_freqs has shape {tuple(factors.shape)}, expected ({self.args[0] // 2},): one per frequency")
        self.freq_factors = factors.detach().float().cpu().clone()
        self.reset_buffers()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the step's positions, (T, head_dim / 2) fp32: indexed once per step and
        shared by every layer."""
        return self.cos[positions], self.sin[positions]


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated: in place by one native call on CPU (they are fresh projections),
    else by `apply_rope`."""
    ops = cpu.native_for(q, k)
    if ops is not None:
        ops.rope_(q, k, cos, sin)
        return q, k
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotate-half, x * cos + rotate_half(x) * sin: (T, heads, D) by (T, D / 2) tables.
    In fp32 whatever x is: rotating in bf16 derails SmolLM2's greedy answers."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU (or GeGLU with the tanh GELU: Gemma) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        gate, up = h.split(self.inter, dim=-1)
        if self.act == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        ops = cpu.native_for(h)
        if ops is not None and h.is_contiguous():
            return self.down_proj(ops.silu_and_mul(h))
        return self.down_proj(F.silu(gate) * up)
