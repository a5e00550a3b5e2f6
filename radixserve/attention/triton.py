"""Attention through the Triton kernels of `kernels/`: each layer stores its new K/V
(store_kv), then decode rows go through the split-KV decode kernel and prefill chunks through
the extend kernel; both read K/V in place through per-request slot tables, so a radix-cache
hit or a fork costs no copy. The tables are built once per batch in `prepare`.

Chosen by `--attention-backend triton`, and by `auto` on CUDA. On CPU it runs only under
TRITON_INTERPRET=1 (slowly: that is how CI tests it end to end on a tiny model).

A pool not in the activations' dtype (int8, fp8, or bf16 under fp32) is stored through
`KVPool.store` (quantized in torch), and each layer dequantizes the batch's touched slots, in
torch, into a compact pool the kernels read through remapped tables: correct, but it costs a
copy of every touched row per layer. Kernels that read quantized rows in place are not written.
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve.attention.base import AttnBackend
from radixserve.attention.torch_flash import band_bias, plain_attention_lse
from radixserve.batch import ForwardBatch, SeqView
from radixserve.cache.pool import KVPool
from radixserve_kernels._triton import interpreting
from radixserve_kernels.decode_attention import decode_attention_triton
from radixserve_kernels.extend_attention import extend_attention_triton
from radixserve_kernels.store_kv import store_kv_triton


class TritonBackend(AttnBackend):
    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        if pool.k[0].device.type != "cuda" and not interpreting():
            raise ValueError("attention_backend: triton needs a CUDA device (on CPU, set TRITON_INTERPRET=1 to run its "
                             "kernels in the interpreter, for tests)")

    def prepare(self, batch: ForwardBatch) -> None:
        dev = batch.input_ids.device
        seqs = batch.seqs
        if self.pool.kv_dtype != self.pool.dtype:
            touched, seqs = _compact(seqs)
            batch.attn_meta["touched"] = touched.to(dev)
        dec = [r for s in seqs if s.q_len == 1 or s.as_rows for r in (s.rows() if s.as_rows else [s])]  # drafts: as decodes
        ext = [s for s in seqs if s.q_len > 1 and not s.as_rows]
        if dec:
            batch.attn_meta["decode"] = _decode_meta(dec, dev)
        if ext:
            batch.attn_meta["extend"] = (_ints([s.q_start for s in ext], dev), _ints([s.q_len for s in ext], dev),
                                         _ints([s.prefix_len for s in ext], dev), _table(ext, dev), max(s.q_len for s in ext))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("the Triton attention kernels have no attention sinks (resolve_backend_name refuses them)")
        meta = self._windowed(batch, window) if window else batch.attn_meta
        out_slots = batch.out_for(window)
        if meta.get("touched") is not None:
            self.pool.store(layer, out_slots, k, v)
            kp, vp = self.pool.read(layer, meta["touched"])
        else:
            kp, vp = self.pool.k[layer], self.pool.v[layer]
            store_kv_triton(kp, vp, out_slots, k, v)
        out = torch.empty_like(q)
        if window:  # chunks in torch under the band mask (the extend kernel has no window)
            if meta["decode"] is not None:
                decode_attention_triton(q, kp, vp, out, *meta["decode"])
            for rows, slots, bias in meta["extends"]:
                k, v = (x.index_select(0, slots).transpose(0, 1)[None] for x in (kp, vp))
                out[rows] = plain_attention_lse(q[rows].transpose(0, 1)[None], k, v, bias=bias)[0][0].transpose(0, 1)
            return out
        if "decode" in meta:
            rows, table, lens = meta["decode"]
            decode_attention_triton(q, kp, vp, out, rows, table, lens)
        if "extend" in meta:
            starts, q_lens, prefix_lens, table, longest = meta["extend"]
            extend_attention_triton(q, kp, vp, out, starts, q_lens, prefix_lens, table, longest)
        return out

    def _windowed(self, batch: ForwardBatch, window: int) -> dict:
        """A sliding-window layer's plan, made once per step and window: decode rows over their
        last `window` slots (in the window pool's slots where it has its own), chunks with the
        band mask; compacted like the full layers' when the pool is not in the activations' dtype."""
        key = f"window{window}"
        if key not in batch.attn_meta:
            dev, seqs = batch.input_ids.device, batch.seqs
            dec = [r.windowed(window) for s in seqs if s.q_len == 1 or s.as_rows for r in (s.rows() if s.as_rows else [s])]
            ext = [s.windowed(window) for s in seqs if s.q_len > 1 and not s.as_rows]
            touched = None
            if self.pool.kv_dtype != self.pool.dtype:
                touched, both = _compact(dec + ext)
                touched, dec, ext = touched.to(dev), both[: len(dec)], both[len(dec) :]
            batch.attn_meta[key] = {
                "touched": touched,
                "decode": _decode_meta(dec, dev) if dec else None,
                "extends": [(slice(w.q_start, w.q_start + w.q_len), torch.tensor(w.slots, dtype=torch.int64, device=dev),
                             band_bias(w.q_len, w.kv_len, window, torch.float32, dev)) for w in ext],
            }
        return batch.attn_meta[key]


def _compact(seqs: list[SeqView]) -> tuple[torch.Tensor, list[SeqView]]:
    """The distinct slots the sequences read, and the sequences with their slots renumbered
    as indices into that list (rows of the compact pool)."""
    touched, where = torch.unique(torch.tensor([x for s in seqs for x in s.slots], dtype=torch.int64), return_inverse=True)
    out, at = [], 0
    for s in seqs:
        out.append(dataclasses.replace(s, slots=where[at : at + len(s.slots)].tolist()))
        at += len(s.slots)
    return touched, out


def _decode_meta(dec: list[SeqView], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ints([s.q_start for s in dec], dev), _table(dec, dev), _ints([s.kv_len for s in dec], dev)


def _ints(xs: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32).to(dev, non_blocking=True)


def _table(seqs: list[SeqView], dev: torch.device) -> torch.Tensor:
    """(len(seqs), longest) int32 slot table; the padding is never read (lengths bound it)."""
    table = torch.zeros(len(seqs), max(s.kv_len for s in seqs), dtype=torch.int32)
    for i, s in enumerate(seqs):
        table[i, : s.kv_len] = torch.tensor(s.slots, dtype=torch.int32)
    return table.to(dev, non_blocking=True)
