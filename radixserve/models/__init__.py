"""Model registry: the one place an HF architecture name becomes a class (imported lazily)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from radixserve.models.config import ArchConfig

if TYPE_CHECKING:
    from torch import nn

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "SmolLM3ForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "radixserve.models.llama:LlamaForCausalLM",  # the text model (270M, 1B; GGUF gemma3)
    # mixtures of experts (models/moe.py): the same decoder, routed MLPs
    "Qwen3MoeForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
    "GptOssForCausalLM": "radixserve.models.llama:LlamaForCausalLM",  # + attention sinks, YaRN, biased experts
}

SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


def model_class(arch: str) -> type[nn.Module]:
    if arch not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _REGISTRY[arch].split(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["ArchConfig", "SUPPORTED_ARCHITECTURES", "model_class"]
