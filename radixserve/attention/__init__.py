"""Attention backend registry: the one place a backend name becomes a class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixserve.attention.base import AttnBackend
    from radixserve.cache.pool import KVPool

_BACKENDS = {
    "torch": "radixserve.attention.torch_flash:TorchFlashBackend",  # fused attention, shared-prefix decode
    "torch_ref": "radixserve.attention.torch_ref:TorchRefBackend",  # the simple oracle
    "triton": "radixserve.attention.triton:TritonBackend",  # kernels/ (CUDA; CPU only under TRITON_INTERPRET=1)
}
CHOICES = ("auto", *_BACKENDS)


def resolve_backend_name(name: str, device: torch.device, sinks: bool = False) -> str:
    """`sinks`: the model adds a sink logit to each head's softmax (gpt-oss), which the torch
    backends compute and the Triton kernels do not."""
    if name == "auto":
        return "triton" if device.type == "cuda" and not sinks else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: {name!r} is not available; choose from: {', '.join(CHOICES)}")
    if sinks and name == "triton":
        raise ValueError("attention_backend: triton has no attention sinks, which this model's attention adds; "
                         "use torch or torch_ref")
    return name


def create_backend(name: str, pool: KVPool, device: torch.device, sinks: bool = False) -> AttnBackend:
    module, cls = _BACKENDS[resolve_backend_name(name, device, sinks)].split(":")
    return getattr(importlib.import_module(module), cls)(pool)
