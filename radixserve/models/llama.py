"""The Llama family on the KV pool: Llama (SmolLM2), SmolLM3 (no rope in every fourth layer),
Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), their mixtures of experts (Qwen3-MoE,
Qwen2-MoE, Mixtral: routed MLPs, models/moe.py), gpt-oss (routed, with a sink logit per head,
sliding-window layers between full ones, YaRN, biases everywhere),
and Gemma 3 (q/k RMSNorm, a norm after attention and after the MLP, GELU-tanh, scaled embeddings,
norm weights as 1 + w, five sliding-window layers per global one, each kind with its own rope base).

The model sees flat tokens (T, hidden) with their positions; attention goes through
`batch.attn_backend`, which owns the KV slots. Weights: fused q/k/v and gate/up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from radixserve.batch import ForwardBatch, LoRARows, NativeDecode
from radixserve.models.config import ArchConfig
from radixserve.models.gguf import ROPE_FREQS
from radixserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, rope_qk
from radixserve.models.linear import PACKED_MAX_ROWS, PackedLinear
from radixserve.models.lora import LoRAContext, LoRALinear
from radixserve.models.moe import MoE
from radixserve.models.quant import QuantLinear, SplitQuantLinear
from radixserve_kernels import cpu

Rope = tuple[torch.Tensor, torch.Tensor]  # the step's (cos, sin), see RotaryEmbedding.tables


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.layer_windows[layer_id] if cfg.layer_windows else 0
        # the backends scale by head_dim ** -0.5: another softmax scale goes into q
        self.q_scale = cfg.attn_scale * self.head_dim**0.5 if cfg.attn_scale else None
        self.sinks = nn.Parameter(torch.empty(self.heads)) if cfg.attn_sinks else None  # gpt-oss: a logit per head

    def forward(self, rope: Rope | None, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # contiguous: the native norm, as the fused step
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if rope is not None:  # None: a NoPE layer
            q, k = rope_qk(q, k, *rope)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (MoE(cfg) if layer_id in cfg.moe_layers
                               else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act))
        if cfg.sandwich_norm:  # Gemma: post_attention_layernorm normalizes the attention's output
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norm

    def forward(self, rope: Rope | None, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual before it): each residual add is fused into
        the norm that follows it (the last one into the model's final norm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, batch)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class FusedDecode:
    """Every decoder layer's weights as `radixserve_kernels.cpu` decode_layers takes them, handed to the
    kernels once: a decode-only step (one token per row, no shared-prefix group, few rows) then
    runs all layers in one native call, with the same kernels the per-layer path calls, minus its
    Python. Takes Qwen2's q/k/v biases, Qwen3's q/k norms, linears split by GGUF kind, and routed
    layers whose experts are quantized (a GGUF file's Qwen3-MoE or Mixtral: routed and grouped
    in the native call as moe.grouped_modules does it)."""

    def __init__(self, model: LlamaModel, linears: list[list[list[Any]]], routed: dict[int, MoE], act_bits: int) -> None:
        self.ops: Any = linears[0][0][0].native
        layers = model.decoder_layers()
        self.layers = len(layers)
        attn = layers[0].self_attn
        norms = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
        parts = [[[(m.packed, m.out_features, m.native_bias) for m in layer] for layer in slot] for slot in linears]
        inter = next((cast(GatedMLP, layer.mlp).inter for i, layer in enumerate(layers) if i not in routed), 0)
        self.weights = self.ops.decode_weights(
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            [q.weight for q, _ in norms if q is not None], [k.weight for _, k in norms if k is not None],
            *parts, attn.heads, attn.kv_heads, attn.head_dim, inter, model.norm.eps, attn.head_dim**-0.5, act_bits)
        for i, moe in routed.items():
            experts = cast(list[GatedMLP], list(cast(nn.ModuleList, moe.experts)))
            self.ops.decode_moe(self.weights, i, cast(PackedLinear, moe.gate).packed,
                                [cast(QuantLinear, m.gate_up_proj).packed for m in experts],
                                [cast(QuantLinear, m.down_proj).packed for m in experts], moe.inter, moe.top_k, moe.renormalize)

    @classmethod
    def of(cls, model: LlamaModel) -> FusedDecode | None:
        """The fused step, where every linear has native packed weights (float panels or
        quantized blocks, whole or in parts) and the layer is Llama's (not Gemma's); else None.
        Sliding windows: `LlamaModel.forward` takes it only while every row is inside them."""
        cfg = model.cfg
        if (cfg.sandwich_norm or cfg.hidden_act != "silu" or cfg.attn_scale or cfg.local_rope_theta or cfg.nope_layers
                or cfg.attn_sinks):
            return None
        linears: list[list[list[Any]]] = [[], [], [], []]  # qkv, o, gate_up, down: per layer, the parts
        routed: dict[int, MoE] = {}
        bits: set[int] = set()
        for i, layer in enumerate(model.decoder_layers()):
            attn, mlp = layer.self_attn, layer.mlp
            modules: list[nn.Module] = [attn.qkv_proj, attn.o_proj]
            if isinstance(mlp, MoE):
                experts = _native_experts(mlp)
                if experts is None:
                    return None
                routed[i] = mlp
                bits |= {m.act_bits for m in experts}
                linears[2].append([])
                linears[3].append([])
            else:
                modules += [cast(GatedMLP, mlp).gate_up_proj, cast(GatedMLP, mlp).down_proj]
            for held, module in zip(linears, modules):
                parts = _native_parts(module)
                if parts is None:
                    return None
                held.append(parts)
        bits |= {m.act_bits for slot in linears for layer in slot for m in layer if isinstance(m, QuantLinear)}
        if 0 in bits or len(bits) > 1:  # float activations (dequantized per call), or a mix: layer by layer
            return None
        return cls(model, linears, routed, bits.pop() if bits else 16) if len(model.layers) else None

    def run(self, x: torch.Tensor, rope: Rope, plan: NativeDecode, lora: LoRARows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """lora: the rows' adapters, whose deltas the native call adds after each linear as
        models.lora.LoRALinear does layer by layer (the same kernel, so the same numbers)."""
        rows, bounds, adapters = None, [], []
        if lora is not None:
            rows, bounds = lora.rows, [b for _, lo, hi in lora.groups for b in (lo, hi)]
            adapters = [adapter.step_weights(self.ops, self.layers) for adapter, _, _ in lora.groups]
        x, residual = self.ops.decode_layers(x, *rope, plan.k_pools, plan.v_pools, plan.out_slots, plan.rows, plan.table,
                                             plan.lens, self.weights, plan.k_scales, plan.v_scales, rows, bounds, adapters)
        return x, residual


def _native_experts(moe: MoE) -> list[QuantLinear] | None:
    """A routed layer's expert linears where the fused step runs them as moe.grouped_modules
    would (quantized, native, no bias; a float router panel; no shared expert, not split over
    ranks), else None."""
    if moe.experts is None or moe.shared_expert is not None or moe.group is not None:
        return None
    gate = moe.gate
    if not (isinstance(gate, PackedLinear) and gate.native is not None and gate.bias is None):
        return None
    linears = [m for e in moe.experts for m in (e.gate_up_proj, e.down_proj)]
    if not all(isinstance(m, QuantLinear) and m.native is not None and m.bias is None for m in linears):
        return None
    return cast(list[QuantLinear], linears)


def _native_parts(module: nn.Module) -> list[nn.Module] | None:
    """A linear's packed parts as the fused step runs them (each adds its fp32 bias in its
    kernel: a split linear's slices too); None where a part has no native kernel. (A LoRALinear:
    its base's; the step adds the adapters' deltas itself.)"""
    if isinstance(module, LoRALinear):
        module = module.base
    if isinstance(module, SplitQuantLinear):
        if module.bias is not None and not module.bias_in_parts:
            return None
        parts = list(module.parts)
    else:
        parts = [module]
    if not all(isinstance(m, (PackedLinear, QuantLinear)) and m.native and (m.bias is None or m.native_bias is not None)
               for m in parts):
        return None
    return parts


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = None  # Gemma 3's windowed layers: their own base, unscaled
        if cfg.local_rope_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.local_rope_theta, None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused: FusedDecode | None = None  # see LlamaForCausalLM.fuse_decode
        self.lora_ctx: LoRAContext | None = None  # with LoRA adapters (engine/lora.py): the batch's rows for them
        self.min_window = min((w for w in cfg.layer_windows if w), default=0)

    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = self.rotary_emb.tables(positions)
        plan = None
        if (self.fused is not None and x.shape[0] <= PACKED_MAX_ROWS and cpu.native_for(x) is not None
                and (batch.lora is None or x.dtype == torch.float32)  # adapters: the native kernel's fp32 rows
                and not (self.min_window and max(s.kv_len for s in batch.seqs) > self.min_window)):
            plan = batch.attn_backend.native_decode(batch)
        if plan is not None and self.fused is not None:
            x, residual = self.fused.run(x, rope, plan, batch.lora)
        else:
            local = self.rotary_local.tables(positions) if self.rotary_local is not None else rope
            residual = None
            if self.lora_ctx is not None:
                self.lora_ctx.rows = batch.lora
            try:
                for i, layer in enumerate(self.decoder_layers()):
                    x, residual = layer(None if i in self.cfg.nope_layers else local if layer.self_attn.window else rope,
                                        x, residual, batch)
            finally:
                if self.lora_ctx is not None:
                    self.lora_ctx.rows = None
        return self.norm(x, residual)[0]


def _gpt_oss(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A gpt-oss checkpoint tensor under our name and layout: the router is `gate`; float experts
    are stored input-major, (experts, in, out), with each gate output beside its up output
    (interleaved), where ours are (experts, out, in) with the gate rows then the up rows. (Their
    biases and MXFP4 blocks come per expert: moe.gpt_oss_experts.)"""
    name = name.replace(".mlp.router.", ".mlp.gate.").replace(".sinks.weight", ".sinks")  # (the latter: a GGUF file's)
    if name.endswith("experts.gate_up_proj"):
        t = tensor.transpose(1, 2)
        return name, torch.cat([t[:, 0::2], t[:, 1::2]], 1)
    if name.endswith("experts.down_proj"):
        return name, tensor.transpose(1, 2)
    return name, tensor


# an expert's HF tensor (Qwen's names, Mixtral's) -> (our 3-D parameter, its half of w13: gate 0, up 1)
_EXPERT = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
           "down_proj": ("w2", None), "w2": ("w2", None)}

# HF checkpoint name -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_decode(self) -> bool:
        """Run decode-only steps through one native call (`FusedDecode`) where the weights allow
        it (after `pack_linears`); returns whether they do."""
        self.model.fused = FusedDecode.of(self.model)
        return self.model.fused is not None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states (T, hidden) of every fed token."""
        return self.model(batch.input_ids, batch.positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _shard_bounds(self, fused: str, shard: int, rows: int) -> tuple[int, int]:
        """Shard `shard`'s rows of a fused parameter of `rows` rows (gate_up: two halves)."""
        c = self.cfg
        if fused == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        inter = rows // 2
        return (shard * inter, (shard + 1) * inter)

    def _place(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str, torch.Tensor, object, int]:
        """Where checkpoint tensor `name` goes: (the parameter, the part of it the tensor fills,
        which piece that part is, how many pieces fill the parameter)."""
        key = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the routed MLP
        parts = key.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            base, rest = ".".join(parts[:at]), parts[at + 1:]
            if len(rest) == 3 and rest[0].isdigit() and rest[1] in _EXPERT and rest[2] in ("weight", "bias"):  # experts.{j}.w1.weight
                which, half = _EXPERT[rest[1]]
                if rest[2] == "bias":  # (gpt-oss's, from a GGUF file: b13 / b2)
                    which = which.replace("w", "b")
                target, j = f"{base}.{which}", int(rest[0])
                if target in params:
                    p = params[target]
                    if j >= p.shape[0]:
                        raise ValueError(f"checkpoint tensor {name!r}: expert {j}, but the config has {p.shape[0]} experts")
                    return target, p[j] if half is None else p[j].chunk(2)[half], (j, half), p.shape[0] * (1 if half is None else 2)
            elif rest in (["gate_up_proj"], ["down_proj"]):  # transformers 5's fused experts: (experts, out, in)
                target = f"{base}.{'w13' if rest[0] == 'gate_up_proj' else 'w2'}"
                if target in params:
                    return target, params[target], None, 1
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target in params:
                lo, hi = self._shard_bounds(fused, shard, params[target].shape[0])
                return target, params[target][lo:hi], shard, 3 if fused == "qkv_proj" else 2
        if key not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
        return key, params[key], None, 1

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v, gate/up and each layer's experts. Every
        parameter must be set, every piece of it."""
        params = dict(self.named_parameters())
        got: dict[str, set[object]] = {}
        need: dict[str, int] = {}
        for name, tensor in weights:
            if self.cfg.sandwich_norm and name.endswith("norm.weight"):  # Gemma scales by 1 + w
                tensor = tensor.float() + 1.0
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            if name == ROPE_FREQS:
                self.model.rotary_emb.set_freq_factors(tensor)
                continue
            if self.cfg.attn_sinks:
                name, tensor = _gpt_oss(name, tensor)
            target, dst, piece, pieces = self._place(name, params)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            got.setdefault(target, set()).add(piece)
            need[target] = 1 if piece is None else pieces
        missing = {n for n in params if len(got.get(n, ())) < need.get(n, 1)}
        if self.cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
