"""Reference attention in plain torch: runs anywhere, and is the oracle for the others.

Decode rows (one query each) run as one padded batch, with the `group` query heads that
share a KV head folded into the query-length dimension (no K/V copy per query head); each
extend sequence (a prefill chunk over its cached prefix) runs on its own. Every K/V row is
read back from the pool (`KVPool.read`: dequantized, for an int8 or fp8 pool), the rows just
stored included. Attention sinks (gpt-oss) are computed as transformers' eager attention does:
the sink a last column of each head's scores, its share of the softmax dropped.
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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, window: int = 0,
        sinks: torch.Tensor | None = None,
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
            od = _attend(qd, kd, vd, meta["dec_mask"], None if sinks is None else sinks.view(1, kv_heads, group, 1))
            out.index_copy_(0, rows, od.reshape(b, heads, dim))
        for s, slots in meta["extend"]:
            rows = slice(s.q_start, s.q_start + s.q_len)
            qe = q[rows].transpose(0, 1)  # (heads, n, dim)
            ke, ve = (x.transpose(0, 1) for x in self.pool.read(layer, slots))  # (kv_heads, L, dim)
            if s.prefix_len == 0 and not (window and s.q_len > window) and sinks is None:
                oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                mask = _causal_mask(meta, s.prefix_len, s.q_len, q.device, window)
                oe = _attend(qe[None], ke[None], ve[None], mask, None if sinks is None else sinks.view(1, heads, 1, 1))[0]
            out[rows] = oe.transpose(0, 1)
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q (B, H, n, D) over k/v (B, KVH, L, D) where `mask` (broadcast to (B, H, n, L)) is True; with
    `sinks` (broadcast to (B, H, n, 1): each query head's), the sink logit joins each query's
    softmax and its share is dropped. (B, H, n, D)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    b, h, n, d = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * d**-0.5
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(torch.cat([s, sinks.float().expand(b, h, n, 1)], -1), -1)[..., :-1]
    return (p @ v.float()).to(q.dtype)


def _causal_mask(meta: dict, prefix: int, n: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """(n, prefix + n) bool: query i (at position prefix + i) may see keys 0 .. prefix + i, and
    with a window only the last `window` of them."""
    key = ("mask", prefix, n)
    if key not in meta:
        qpos = (torch.arange(n, device=device) + prefix)[:, None]
        kpos = torch.arange(prefix + n, device=device)[None, :]
        meta[key] = (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos
    return meta[key]
