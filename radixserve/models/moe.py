"""Mixture-of-experts MLP blocks: Qwen3-MoE, Qwen2-MoE (a shared expert behind a sigmoid gate),
Mixtral and gpt-oss (biases on the router and the experts, a clamped SwiGLU), as transformers
computes them.

A router (a linear to one logit per expert) picks each token's top k experts by softmax
probability (fp32), renormalised over the k where the family does (Mixtral always; Qwen by
`norm_topk_prob`). The expert step groups the batch's (token, expert) pairs by expert and runs
each chosen expert's SwiGLU on just its rows, so a decode step reads only the chosen experts'
weights; the weighted outputs are added back per token (`index_add_`, one row per pair).

The experts' weights are 3-D tensors: `w13` (experts, 2 * inter, hidden) holding each expert's
gate then up rows, `w2` (experts, hidden, inter), loaded from the per-expert tensors of a hub
checkpoint (`experts.{j}.gate_proj` / `w1`, `up_proj` / `w3`, `down_proj` / `w2`) or from
transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`. A GGUF file's quantized
experts are one gated MLP each instead (`experts_as_modules`: quantized linears over the file's
blocks), a layer's chosen ones run in two native calls (`qlinear_many`). `--expert-parallel`
keeps each rank's share of the experts and sums the ranks' outputs (`keep_experts`). On CUDA the
float experts run in two grouped Triton GEMMs (radixserve_kernels.fused_moe), this module's
grouped_experts their reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.models.config import ArchConfig
from radixserve.models.layers import GatedMLP
from radixserve_kernels._triton import use_triton
from radixserve_kernels.fused_moe import fused_moe_triton


def describe(cfg: ArchConfig) -> dict[str, int] | None:
    """A routed model's experts for /server_info: how many, how many a token takes, the routed
    layers, and its parameters (counted from the shapes, however they are stored), all and those
    a token reads (the experts it does not choose left out); None for a dense model."""
    if not cfg.moe_layers:
        return None
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = (h * (q + 2 * kv) + q * h + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0) + ((q + 2 * kv) if cfg.qkv_bias else 0)
            + (h if cfg.o_bias else 0) + (cfg.num_heads if cfg.attn_sinks else 0))
    inter = cfg.moe_intermediate_size
    expert = 3 * h * inter + ((2 * inter + h) if cfg.expert_bias else 0)
    shared = 3 * h * cfg.shared_expert_intermediate_size + h if cfg.shared_expert_intermediate_size else 0
    routed = len(cfg.moe_layers)
    dense = (cfg.num_layers - routed) * 3 * h * cfg.intermediate_size
    router = h + (1 if cfg.expert_bias else 0)  # per expert
    mlps = routed * (cfg.num_experts * (expert + router) + shared) + dense
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h + cfg.num_layers * attn + mlps
    idle = routed * (cfg.num_experts - cfg.experts_per_token) * expert
    return {"experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token, "routed_layers": len(cfg.moe_layers),
            "parameters": total, "active_parameters": total - idle}


def idle_bytes(model: nn.Module) -> int:
    """The bytes of experts a decode step at batch 1 does not read, on average: each routed
    layer's expert weights (as held: quantized blocks or float tensors) times 1 - top_k / experts.
    A step reads the model's weight bytes less these (`bench compare --roof` counts those)."""
    from radixserve.models.quant import weight_bytes

    idle = 0.0
    for m in model.modules():
        if isinstance(m, MoE):
            held = weight_bytes(m.experts) if m.experts is not None else sum(
                t.untyped_storage().nbytes() for t in (m.w13, m.w2, m.b13, m.b2) if t is not None)
            idle += held * (1 - m.top_k / m.gate.out_features)
    return round(idle)


def gpt_oss_experts(weights: Iterable[tuple[str, Any]], keep_blocks: bool = True) -> Iterator[tuple[str, Any]]:
    """A gpt-oss checkpoint's experts one by one, as the loader takes them: the released
    safetensors' MXFP4 `experts.{gate_up,down}_proj_blocks` / `_scales` as a quantized tensor
    per expert and projection (`experts.{j}.gate_proj.weight`: GGUF's MXFP4 blocks, served from
    them; gate and up are the even and odd rows of gate_up), or dequantized (`keep_blocks` False:
    `--quantization` other than auto, or no CPU kernels), and the experts' fused biases as each
    one's (`experts.{j}.gate_proj.bias`); every other tensor as it is."""
    from radixserve.models.quant import QuantTensor, mxfp4_blocks

    held: dict[str, torch.Tensor] = {}  # a blocks or scales tensor until its other half comes
    for name, t in weights:
        base, _, leaf = name.rpartition(".experts.")
        if leaf in ("gate_up_proj_bias", "down_proj_bias"):
            for j in range(t.shape[0]):
                if leaf == "down_proj_bias":
                    yield f"{base}.experts.{j}.down_proj.bias", t[j]
                else:
                    yield f"{base}.experts.{j}.gate_proj.bias", t[j, 0::2]
                    yield f"{base}.experts.{j}.up_proj.bias", t[j, 1::2]
            continue
        if not leaf.endswith(("_blocks", "_scales")):
            yield name, t
            continue
        proj, _, half = leaf.rpartition("_")
        other = f"{base}.experts.{proj}_{'scales' if half == 'blocks' else 'blocks'}"
        if other not in held:
            held[name] = t
            continue
        blocks, scales = (t, held.pop(other)) if half == "blocks" else (held.pop(other), t)
        if blocks.dim() != 4 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
            raise ValueError(f"checkpoint tensors {name!r} and {other!r}: MXFP4 blocks (experts, out, in/32, 16) and "
                             f"scales (experts, out, in/32), got {tuple(blocks.shape)} and {tuple(scales.shape)}")
        k = blocks.shape[2] * 32
        for j in range(blocks.shape[0]):
            rows = mxfp4_blocks(blocks[j], scales[j])
            parts = [("down_proj", rows)] if proj == "down_proj" else [("gate_proj", rows[0::2]), ("up_proj", rows[1::2])]
            for part, raw in parts:
                q = QuantTensor("mxfp4", raw.contiguous(), raw.shape[0], k)
                yield f"{base}.experts.{j}.{part}.weight", q if keep_blocks else q.dequantize()
    if held:
        raise ValueError(f"checkpoint tensor {next(iter(held))!r}: MXFP4 blocks without their scales, or scales without blocks")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each (tokens, top_k): the top k of the softmax over every expert's
    logit, in fp32, renormalised to sum to one when asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _groups(experts: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its (token, k) pairs as flat indices, their tokens) for every expert chosen
    (an expert of -1: another rank's, skipped)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows = order // experts.shape[1]
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    return [(e, order[a:b], rows[a:b]) for e, a, b in zip(ids.tolist(), bounds, bounds[1:]) if e >= 0]


def grouped_modules(x: torch.Tensor, experts: nn.ModuleList, weights: torch.Tensor, chosen: torch.Tensor,
                    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """grouped_experts over experts held as modules (quantized linears): each chosen one runs
    once, on its rows. Where every chosen expert is one packed gate_up and one packed down on the
    native kernels, the native `moe_experts` does it all (the chosen experts' gate_ups in one
    parallel region, their downs in another; the fused decode step calls the same code), else
    each expert module in turn, grouped here. `packed`: every expert's packed gate_up and down,
    listed once by the caller (else listed here, where every expert has them)."""
    flat = chosen.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=len(experts)).tolist()  # (-1: another rank's expert)
    picked = [e for e, n in enumerate(counts) if n]
    first: Any = experts[picked[0]] if picked else None
    ops = getattr(first.gate_up_proj, "native", None) if first is not None else None
    if packed is None:
        packed = _blocks(experts)
    if ops is not None and packed is not None and all(_one_call(experts[e], counts[e]) for e in picked):
        return ops.moe_experts(x.contiguous(), weights, chosen, *packed, first.inter, first.gate_up_proj.act_bits)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e, pairs, tokens in _groups(chosen):
        y = experts[e](x[tokens]).float()
        out.index_add_(0, tokens, y * weights.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def _blocks(experts: nn.ModuleList) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Every expert's packed gate_up and down blocks (each a quantized linear's `packed`), or None
    where one of them has none."""
    held: list[Any] = list(experts)
    if not all(isinstance(getattr(m, "packed", None), torch.Tensor) for e in held for m in (e.gate_up_proj, e.down_proj)):
        return None
    return [m.gate_up_proj.packed for m in held], [m.down_proj.packed for m in held]


def _one_call(expert: nn.Module, rows: int) -> bool:
    """Whether an expert's two linears run in qlinear_many on `rows` rows: packed quantized
    weights whose own calls would take the integer kernel for that many rows (QuantLinear.native_rows:
    a prefill chunk only where it outruns dequantizing), no bias, gate and up in one kind."""
    from radixserve.models.quant import QuantLinear

    return all(isinstance(m, QuantLinear) and m.native_rows(rows) and m.bias is None
               for m in (expert.gate_up_proj, expert.down_proj))


def gated(h: torch.Tensor, inter: int, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """An expert's activation from its gate and up halves: SiLU(gate) * up, or gpt-oss's clamped
    SwiGLU where `limit` is set (gate <= limit, |up| <= limit, gate * sigmoid(alpha gate) * (up + 1))."""
    gate, up = h[:, :inter], h[:, inter:]
    if not limit:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, alpha: float = 0.0,
                    limit: float = 0.0) -> torch.Tensor:
    """sum over k of weights[t, k] * expert[experts[t, k]](x[t]) for every token t, each expert
    run once on the rows that chose it (an expert no row chose is never read); the experts'
    biases b13 (E, 2 * inter), b2 (E, hidden) and activation (`gated`) where the family has them."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e, pairs, tokens in _groups(experts):
        h = F.linear(x[tokens], w13[e], None if b13 is None else b13[e])
        y = F.linear(gated(h, inter, alpha, limit), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[pairs, None])
    return out.to(x.dtype)


class ClampedExpert(GatedMLP):
    """A gpt-oss expert held as modules (quantized linears, with biases): `gated`'s clamped SwiGLU."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__(hidden, inter, True)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.inter, self.alpha, self.limit))


class MoE(nn.Module):
    """One layer's experts, its router and (Qwen2-MoE) its shared expert."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        e, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate = nn.Linear(hidden, e, bias=cfg.expert_bias)
        self.gate.keep_float = True  # type: ignore[assignment]  # routing logits: --quantization leaves them, as llama.cpp does
        self.w13: nn.Parameter | None = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.w2: nn.Parameter | None = nn.Parameter(torch.empty(e, hidden, inter))
        self.b13 = nn.Parameter(torch.empty(e, 2 * inter)) if cfg.expert_bias else None  # gpt-oss's expert biases
        self.b2 = nn.Parameter(torch.empty(e, hidden)) if cfg.expert_bias else None
        self.experts: nn.ModuleList | None = None  # quantized experts: a gated MLP each (see experts_as_modules)
        self.inter = inter
        self.lo, self.hi = 0, e  # the experts this rank holds (--expert-parallel: see keep_experts)
        self.group: Any = None  # their rank group, whose all-reduce sums the ranks' outputs
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # quantized experts' blocks (_blocks)
        self.listed = False  # whether `packed` was listed (once, at the first call: after the weights are in)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, cfg.shared_expert_intermediate_size, False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
            self.shared_expert_gate.keep_float = True  # type: ignore[assignment]

    def experts_as_modules(self) -> None:
        """Hold the experts as one gated MLP each (`experts.{j}.gate_up_proj`, `.down_proj`), whose
        linears the loader makes quantized ones over a file's blocks, instead of the 3-D float tensors."""
        e, hidden = self.gate.out_features, self.gate.in_features
        self.w13 = self.w2 = None
        if self.b13 is not None or self.limit:  # gpt-oss: biases in each expert's linears, its clamped SwiGLU
            self.b13 = self.b2 = None
            self.experts = nn.ModuleList(ClampedExpert(hidden, self.inter, self.alpha, self.limit) for _ in range(e))
        else:
            self.experts = nn.ModuleList(GatedMLP(hidden, self.inter, False) for _ in range(e))

    def keep_experts(self, rank: int, size: int, group: Any) -> None:
        """--expert-parallel: keep this rank's experts (an even share, in order) and the shared
        expert on rank 0 only; the layer's output is then this rank's part, summed by `group`."""
        e = self.gate.out_features
        self.lo, self.hi, self.group = rank * e // size, (rank + 1) * e // size, group
        if self.experts is not None:
            self.experts = nn.ModuleList(list(self.experts)[self.lo:self.hi])
        else:
            assert self.w13 is not None and self.w2 is not None
            self.w13 = nn.Parameter(self.w13.data[self.lo:self.hi].clone(), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.data[self.lo:self.hi].clone(), requires_grad=False)
            if self.b13 is not None and self.b2 is not None:
                self.b13 = nn.Parameter(self.b13.data[self.lo:self.hi].clone(), requires_grad=False)
                self.b2 = nn.Parameter(self.b2.data[self.lo:self.hi].clone(), requires_grad=False)
        if rank:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        if self.group is not None:  # this rank's experts only, numbered from its first
            mine = (experts >= self.lo) & (experts < self.hi)
            weights, experts = weights * mine, torch.where(mine, experts - self.lo, -1)
        if self.experts is not None:
            if not self.listed:
                self.packed, self.listed = _blocks(self.experts), True
            out = grouped_modules(x, self.experts, weights, experts, self.packed)
        else:
            assert self.w13 is not None and self.w2 is not None
            if self.b13 is None and not self.limit and use_triton(x):  # CUDA: two grouped Triton GEMMs
                out = fused_moe_triton(x, self.w13, self.w2, weights, experts)
            else:
                out = grouped_experts(x, self.w13, self.w2, weights, experts, self.b13, self.b2, self.alpha, self.limit)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce(out.contiguous()) if self.group is not None else out
