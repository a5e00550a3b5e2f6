"""The attention backend contract."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixserve.batch import ForwardBatch, NativeDecode
from radixserve.cache.pool import KVPool


class AttnBackend(ABC):
    """Attention over the KV pool.

    - `prepare(batch)` runs once per ForwardBatch, before the model; it may store whatever
      it needs in `batch.attn_meta` (index tensors, masks) for all layers to reuse.
    - `forward(q, k, v, layer, batch, window)`: q (T, heads, D), k/v (T, kv_heads, D) for the T
      flat rows. Writes k/v into the pool at `batch.out_slots`, then lets each sequence's
      rows attend causally to its slots (prefix + itself). Returns (T, heads, D). With a
      `window` > 0 (a sliding-window layer) a query at position p sees positions > p - window
      only (`SeqView.windowed`). Where those layers have a pool of their own (KVPool
      window_slots), they write at `batch.out_for(window)` and their windowed views carry
      that pool's slots. `sinks` (heads,): a sink logit in each head's softmax (gpt-oss), in the
      backends that have them (torch, torch_ref; `resolve_backend_name` keeps a model that has
      them off the others).
    - The model knows nothing of slots; the backend never frees or allocates them.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    def native_decode(self, batch: ForwardBatch) -> NativeDecode | None:
        """The batch as a fused CPU decode step can take it, or None (the default: per layer)."""
        return None

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
