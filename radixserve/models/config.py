"""Architecture hyper-parameters read from a Hugging Face config.json (4.x and 5.x dialects)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        is_qwen2, is_qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
        theta, scaling = _rope(cfg)
        max_pos = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            # Sliding-window attention is not implemented: serve only the exact range.
            max_pos = min(max_pos, window)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attn_bias,
            o_bias=False if (is_qwen2 or is_qwen3) else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            eos_token_ids=eos_ids,
        )


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
