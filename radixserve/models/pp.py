"""Pipeline parallelism for the Llama family (`--pipeline-parallel N`): rank r of N holds a
contiguous stage of the decoder layers (split as evenly as they go) and their KV; rank 0 also
holds the embedding, and the final norm and the head. A step's batch is cut into micro-batches
(`micro_batches`); stage r runs each in turn and hands its hidden state and residual to stage
r + 1, so while stage 1 runs the first micro-batch stage 0 already runs the second. The last
stage applies the final norm and hands the hidden state back to rank 0, which computes logits.

Exact to rounding: every layer computes what it computes in one process (a micro-batch's rows
are the batch's, a sequence cut in two is cut as chunked prefill cuts it), but a micro-batch's
row count may pick another matmul kernel (models/linear.py), and a stage runs layer by layer
where one process's decode runs the fused native step: greedy tokens match, logprobs to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from radixserve.batch import ForwardBatch, SeqView
from radixserve.models.tp import split_evenly

MIN_SPLIT_ROWS = 8  # a lone sequence fed fewer rows than this runs as one micro-batch


@dataclass(frozen=True)
class Stage:
    """Rank r's layers [lo, hi)."""

    rank: int
    size: int
    lo: int
    hi: int

    @classmethod
    def of(cls, rank: int, size: int, layers: int) -> Stage:
        if layers < size:
            raise ValueError(f"pipeline_parallel: {size} stages, but the model has {layers} layers; "
                             f"each stage needs at least one (use at most {layers})")
        b = split_evenly(layers, size)
        return cls(rank, size, b[rank], b[rank + 1])

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def cut_model(model: Any, stage: Stage) -> None:
    """Keep a loaded LlamaForCausalLM's layers [lo, hi) (renumbered from 0: they index the
    stage's own KV pool); the embedding, final norm and head stay (rank 0 uses them)."""
    m = model.model
    keep = list(m.layers)[stage.lo : stage.hi]
    for i, layer in enumerate(keep):
        layer.global_id = stage.lo + i  # a NoPE layer is named by its index in the whole model
        layer.self_attn.layer_id = i
    m.layers = torch.nn.ModuleList(keep)
    m.fused = None


@torch.inference_mode()
def run_stage(model: Any, batch: ForwardBatch, x: torch.Tensor | None, residual: torch.Tensor | None,
              stage: Stage) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This stage's layers over one micro-batch: from the token ids on the first stage (x None),
    else from the previous stage's (x, residual). The last stage returns (final hidden, None)."""
    m = model.model
    cfg = m.cfg
    if x is None:
        x = m.embed_tokens(batch.input_ids)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
    rope = m.rotary_emb.tables(batch.positions)
    local = m.rotary_local.tables(batch.positions) if m.rotary_local is not None else rope
    for layer in m.decoder_layers():
        nope = getattr(layer, "global_id", -1) in cfg.nope_layers
        x, residual = layer(None if nope else local if layer.self_attn.window else rope, x, residual, batch)
    if stage.last:
        return m.norm(x, residual)[0], None
    return x, residual


def micro_batches(batch: ForwardBatch, parts: int) -> list[tuple[Any, ...]]:
    """The batch cut into up to `parts` runs of rows, each a micro-batch's parts (ids, positions,
    out slots, sequences re-based to its first row, window out slots): whole sequences where
    there are several, a lone long one cut in two as chunked prefill would."""
    seqs = batch.seqs
    if len(seqs) == 1 and parts > 1:
        s = seqs[0]
        if s.q_len >= MIN_SPLIT_ROWS and not s.as_rows and s.window_slots is None:
            h = s.q_len // 2
            seqs = [SeqView(s.q_start, h, s.prefix_len, s.slots[: s.prefix_len + h]),
                    SeqView(s.q_start + h, s.q_len - h, s.prefix_len + h, s.slots)]
    groups: list[list[SeqView]] = []
    total = sum(s.q_len for s in seqs)
    target = -(-total // parts)
    for s in seqs:
        if not groups or (sum(x.q_len for x in groups[-1]) >= target and len(groups) < parts):
            groups.append([])
        groups[-1].append(s)
    out = []
    for g in groups:
        a, b = g[0].q_start, g[-1].q_start + g[-1].q_len
        wout = batch.window_out_slots[a:b] if batch.window_out_slots is not None else None
        out.append((batch.input_ids[a:b], batch.positions[a:b], batch.out_slots[a:b],
                    [replace(s, q_start=s.q_start - a) for s in g], wout))
    return out
