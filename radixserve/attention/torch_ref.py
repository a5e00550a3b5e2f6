"""Reference attention in plain torch: runs anywhere, and is the oracle for the others.

Decode rows (one query each) run as one padded batch, with the `group` query heads that
share a KV head folded into the query-length dimension (no K/V copy per query head); each
extend sequence (a prefill chunk over its cached prefix) runs on its own. Every K/V row is
read back from the pool (`KVPool.read`: dequantized, for an int8 or fp8 pool), the rows just
stored included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttnBackend
from radixserve.batch import ForwardBatch


class TorchRefBackend(AttnBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        self._plan(batch, batch.attn_meta, 0)

    def _plan(self, batch: ForwardBatch, meta: dict, window: int) -> None:
        dev = batch.input_ids.device
        seqs = [s.windowed(window) for s in batch.seqs]
        dec = [s for s in seqs if s.q_len == 1]
        meta["extend"] = [
            (s, torch.tensor(s.slots, dtype=torch.int64, device=dev)) for s in seqs if s.q_len > 1
        ]
        if dec:
            width = max(s.kv_len for s in dec)
            idx = torch.full((len(dec), width), self.pool.pad_for(window), dtype=torch.int64)
            for i, s in enumerate(dec):
                idx[i, : s.kv_len] = torch.tensor(s.slots, dtype=torch.int64)
            lens = torch.tensor([s.kv_len for s in dec])
            meta["dec_rows"] = torch.tensor([s.q_start for s in dec], device=dev)
            meta["dec_idx"] = idx.to(dev)
            meta["dec_mask"] = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :].to(dev)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, window: int = 0
    ) -> torch.Tensor:
        self.pool.store(layer, batch.out_for(window), k, v)
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        meta = batch.attn_meta
        if window:  # decode rows keep their last `window` slots; chunks get the band mask
            meta = meta.setdefault(f"window{window}", {})
            if "extend" not in meta:
                self._plan(batch, meta, window)
        out = torch.empty_like(q)
        if "dec_rows" in meta:
            rows = meta["dec_rows"]
            b = rows.shape[0]
            qd = q.index_select(0, rows).view(b, kv_heads, group, dim)
            kd, vd = (x.transpose(1, 2) for x in self.pool.read(layer, meta["dec_idx"]))  # (b, kv_heads, L, dim)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta["dec_mask"])
            out.index_copy_(0, rows, od.reshape(b, heads, dim))
        for s, slots in meta["extend"]:
            rows = slice(s.q_start, s.q_start + s.q_len)
            qe = q[rows].transpose(0, 1)  # (heads, n, dim)
            ke, ve = (x.transpose(0, 1) for x in self.pool.read(layer, slots))  # (kv_heads, L, dim)
            if s.prefix_len == 0 and not (window and s.q_len > window):
                oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                mask = _causal_mask(meta, s.prefix_len, s.q_len, q.device, window)
                oe = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask, enable_gqa=True)
            out[rows] = oe.transpose(0, 1)
        return out


def _causal_mask(meta: dict, prefix: int, n: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """(n, prefix + n) bool: query i (at position prefix + i) may see keys 0 .. prefix + i, and
    with a window only the last `window` of them."""
    key = ("mask", prefix, n)
    if key not in meta:
        qpos = (torch.arange(n, device=device) + prefix)[:, None]
        kpos = torch.arange(prefix + n, device=device)[None, :]
        meta[key] = (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos
    return meta[key]
