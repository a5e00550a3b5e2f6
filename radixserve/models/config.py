"""Architecture hyper-parameters read from a Hugging Face config.json (4.x and 5.x dialects).

Sliding-window attention is per layer: `layer_windows[i]` is how many positions layer i's
queries see (the query's own included, as transformers' `kv > q - window`), 0 for full
attention; empty when every layer is full. Gemma 3 interleaves five local layers with one
global one; Mistral (v0.1) and Qwen2 with `use_sliding_window` window some or all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTENTION_SLOWDOWN = 2.0  # attention's cost per FLOP against the linear layers' (ArchConfig.context_cost)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the windowed layers' own rope base (Gemma 3), unscaled
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma)
    embed_scale: float = 1.0  # the embeddings' multiplier (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # the attention's softmax scale, where not head_dim ** -0.5
    sandwich_norm: bool = False  # Gemma: a norm after attention and after the MLP too, and weights as 1 + w
    nope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (SmolLM3: every fourth)
    # mixture of experts (models/moe.py): which layers route, over how many experts, how many a token
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights (Mixtral always; Qwen by config)
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one expert every token takes, behind a sigmoid gate
    expert_bias: bool = False  # gpt-oss: biases on the router and on every expert's linears
    swiglu_limit: float = 0.0  # gpt-oss's clamped SwiGLU (0: plain SiLU gating): gate <= limit, |up| <= limit,
    swiglu_alpha: float = 0.0  # gate * sigmoid(alpha * gate) * (up + 1)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator

    def context_cost(self) -> float:
        """Tokens of context whose attention costs a prefilled token what its linear layers do: a
        chunk of n tokens after s costs about n * (1 + (s + n) / context_cost()) tokens' worth.
        From the FLOPs (projections and MLP: 2 * weights a token; attention: 4 * heads * head_dim
        a context token, for scores and values), halved because attention runs at about half
        the GEMMs' rate per FLOP on a CPU (SmolLM2 on the 2-core EPYC, from step times: ~0.95 us a
        context token against ~1.2 ms a token in the linears, 2.4 times the FLOP ratio). Windowed
        layers are counted as full (an upper bound on the cost)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = 2 * (self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size * self.active_mlp_width())
        return linear / (4 * q) / ATTENTION_SLOWDOWN

    def active_mlp_width(self) -> float:
        """The MLP width a token computes, averaged over the layers: a routed layer's chosen
        experts' and shared expert's, a dense layer's own."""
        if not self.moe_layers:
            return self.intermediate_size
        routed = self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size
        dense = self.num_layers - len(self.moe_layers)
        return (routed * len(self.moe_layers) + dense * self.intermediate_size) / self.num_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        theta, scaling = _rope(cfg)
        max_pos = cfg.get("max_position_embeddings", 2048)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attn_bias = bool(cfg.get("attention_bias", False))
        gemma = arch == "Gemma3ForCausalLM"
        local_theta = None
        if gemma:
            theta, scaling, local_theta = _gemma_rope(cfg)
            for key in ("final_logit_softcapping", "attn_logit_softcapping"):
                if cfg.get(key) is not None:
                    raise ValueError(f"{key}: soft-capping is not supported (Gemma 3 has none)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        head_dim = cfg.get("head_dim") or hidden // heads
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if is_qwen2 else attn_bias,
            o_bias=False if (is_qwen2 or is_qwen3) else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3 or gemma,
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(cfg, arch),
            local_rope_theta=local_theta,
            hidden_act=_ACTIVATIONS[act],
            embed_scale=hidden**0.5 if gemma else 1.0,
            attn_scale=scalar**-0.5 if gemma and scalar and scalar != head_dim else None,
            sandwich_norm=gemma,
            nope_layers=_nope_layers(cfg, arch),
            **_moe(cfg, arch),
        )


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")


def _moe(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The routing fields: Mixtral routes every layer (the experts as wide as `intermediate_size`);
    Qwen's MoE models route the layers transformers does (not in `mlp_only_layers`, every
    `decoder_sparse_step`-th) over experts of `moe_intermediate_size`. gpt-oss routes every layer
    too (a softmax over the top k logits: the top k renormalised), its router and experts with
    biases and its SwiGLU clamped, and adds a sink logit to each head's attention."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    n = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # (transformers 5 writes the latter for both)
    oai: dict[str, Any] = {}
    if arch == "GptOssForCausalLM":
        oai = dict(expert_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), attn_sinks=True)
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        width, renorm, layers = cfg["intermediate_size"], True, tuple(range(n))
    else:
        width = cfg.get("moe_intermediate_size", 0)
        renorm = bool(cfg.get("norm_topk_prob", False))  # transformers' default for both
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    top_k = cfg.get("num_experts_per_tok", {"Qwen3MoeForCausalLM": 8, "Qwen2MoeForCausalLM": 4,
                                             "GptOssForCausalLM": 4}.get(arch, 2))  # (transformers')
    if layers and not (0 < top_k <= experts):
        raise ValueError(f"num_experts_per_tok: {top_k} must be between 1 and the {experts} experts")
    if layers and width <= 0:
        raise ValueError("moe_intermediate_size: the experts' width must be positive")
    shared = cfg.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=width, norm_topk_prob=renorm,
                moe_layers=layers, shared_expert_intermediate_size=shared or 0, **oai)


def _nope_layers(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` lists 1 for a layer that uses rope, 0 for one that does not
    (by default every `no_rope_layer_interval`-th, 4)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    uses = cfg.get("no_rope_layers")
    if not isinstance(uses, list):
        every = cfg.get("no_rope_layer_interval", 4)
        uses = [int((i + 1) % every != 0) for i in range(cfg["num_hidden_layers"])]
    return tuple(i for i, use in enumerate(uses) if not use)


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's window (0: full attention), from `layer_types` where the config lists them
    (transformers 5.x, Gemma 3), else from `sliding_window` as each family applies it: Mistral
    to every layer, Qwen2 (with `use_sliding_window`) to the layers from `max_window_layers` on."""
    window = cfg.get("sliding_window") or 0
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not window:
        return ()
    if isinstance(types, list) and len(types) == n:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif arch == "Gemma3ForCausalLM":  # 4.x configs: every sixth layer is global
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        windows = tuple(0 if (i + 1) % pattern == 0 else window for i in range(n))
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM") and cfg.get("use_sliding_window", True):
        windows = (window,) * n
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window", False):
        first = cfg.get("max_window_layers", n)
        windows = tuple(window if i >= first else 0 for i in range(n))
    else:
        return ()
    return windows if any(windows) else ()


def _gemma_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3's two rotary bases: (global theta, global scaling, local theta). transformers
    5.x keys `rope_parameters` by layer type; 4.x has rope_theta, rope_scaling (global only)
    and rope_local_base_freq."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), params.get("sliding_attention") or {}
        theta, scaling = _rope({"rope_parameters": full})
        if local.get("rope_type", "default") not in (None, "default"):
            raise ValueError("rope_parameters.sliding_attention: only the default rope is supported for local layers")
        return theta, scaling, float(local.get("rope_theta", 10000.0))
    theta, scaling = _rope(cfg)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10000.0))


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5.x puts theta and scaling in `rope_parameters`; 4.x at the top level."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    scaling["rope_type"] = kind
    return float(theta), scaling
