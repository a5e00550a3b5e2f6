"""Fast attention in torch: fused attention that returns its log-sum-exp, so a sequence's KV
can be read in parts and the parts merged exactly (softmax over the union):

    decode  | shared prefix of a fork group | own rest                |
              read once per group, in place   read in place by the native CPU kernel
                                              (kernels/radixserve_kernels/cpu.py), else gathered per request
    extend  | cached prefix                 | the chunk's own k/v    |
              read in place when contiguous   causal, straight from the inputs

Requests forked off one cached prompt hold the same slots for it (the cache manager hands
out the cache's slots), so 16 branches decoding over a 2,000-token prompt read its K/V once
per step instead of 16 times. On CPU the fused kernel is torch's flash attention for CPU;
elsewhere a plain-torch fallback computes the same (output, lse). torch_ref is the oracle
these are tested against.

A quantized pool (int8, fp8) is read in place by the native decode kernel too (its
quantized variant, with the scales); every other read (gathered rows, a fork group's shared
prefix, an extend's prefix) dequantizes the rows it reads. A chunk's own k/v come straight
from its inputs, unquantized, as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttnBackend
from radixserve.batch import ForwardBatch, NativeDecode, SeqView
from radixserve.cache.prefix import common_prefix_len
from radixserve_kernels import cpu
from radixserve_kernels.decode_attention import decode_attention_cpu

MIN_SHARED = 32  # shortest shared prefix worth a separate pass


@dataclass
class _Group:
    members: list[int]  # indices into the decode list
    kv: slice | torch.Tensor  # the shared slots: a slice of the pool when contiguous


class TorchFlashBackend(AttnBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        self._plan(batch, batch.attn_meta, 0)

    def _windowed(self, batch: ForwardBatch, window: int) -> dict:
        """The batch as a sliding-window layer reads it, planned once per step and window."""
        key = f"window{window}"
        if key not in batch.attn_meta:
            batch.attn_meta[key] = {}
            self._plan(batch, batch.attn_meta[key], window)
        return batch.attn_meta[key]

    def _plan(self, batch: ForwardBatch, meta: dict, window: int) -> None:
        dev = batch.input_ids.device
        meta["extend"] = [(w, _slots(w.slots[: w.prefix_len], dev),
                           band_bias(w.q_len, w.kv_len, window, self.pool.dtype, dev) if window and w.kv_len > window else None)
                          for s in batch.seqs if s.q_len > 1 and not s.as_rows for w in [s.windowed(window)]]
        owned = [(n, r.windowed(window)) for n, s in enumerate(batch.seqs) if s.q_len == 1 or s.as_rows
                 for r in (s.rows() if s.as_rows else [s])]
        if not owned:
            return
        dec = [r for _, r in owned]
        groups, shared = _fork_groups(dec, [n for n, _ in owned], dev)
        rest = [s.slots[n:] for s, n in zip(dec, shared)]
        width = max(len(r) for r in rest)
        idx = torch.full((len(dec), width), self.pool.pad_for(window), dtype=torch.int64)
        for i, r in enumerate(rest):
            idx[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        meta["dec_rows"] = torch.tensor([s.q_start for s in dec], device=dev)
        meta["dec_idx"] = idx.to(dev)
        meta["dec_groups"] = groups
        lens = torch.tensor([len(r) for r in rest])
        if self._reads_in_place():
            meta["dec_lens"] = lens
        else:
            bias = torch.zeros(len(dec), width, dtype=self.pool.dtype)
            bias.masked_fill_(torch.arange(width)[None, :] >= lens[:, None], float("-inf"))
            meta["dec_bias"] = bias[:, None, None, :].to(dev)

    def _reads_in_place(self) -> bool:
        """Whether the native CPU decode kernel reads this pool: stored in the activations'
        dtype, or quantized (read with its scales)."""
        p = self.pool
        if p.dtype not in (torch.float32, torch.bfloat16) or (p.kv_dtype != p.dtype and not p.quantized):
            return False  # e.g. bf16 rows for fp32 activations: gathered and widened
        return p.k[0].device.type == "cpu" and cpu.ops() is not None

    def native_decode(self, batch: ForwardBatch) -> NativeDecode | None:
        """The fused step stores and reads a pool in the activations' dtype, or an int8 / fp8 one
        with its scales; None for another float dtype (a bf16 pool under an fp32 model), and
        where the sliding-window layers have a pool of their own (one slot table serves all)."""
        meta = batch.attn_meta
        pool = self.pool
        if ("dec_lens" not in meta or meta["extend"] or meta["dec_groups"] or pool.window_slots
                or (pool.kv_dtype != pool.dtype and not pool.quantized)):
            return None
        return NativeDecode(pool.k, pool.v, batch.out_slots, meta["dec_rows"], meta["dec_idx"], meta["dec_lens"],
                            pool.k_scale, pool.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
                window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.pool.store(layer, batch.out_for(window), k, v)
        meta = self._windowed(batch, window) if window else batch.attn_meta
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device) if sinks is not None else None
        if "dec_rows" in meta:
            self._decode(q, layer, meta, out, lse)
        for s, prefix, band in meta["extend"]:
            rows = slice(s.q_start, s.q_start + s.q_len)
            read = self.pool.read(layer, prefix) if s.prefix_len else None
            if band is not None:
                out[rows], lse_rows = _extend_window(q[rows], k[rows], v[rows], read, band.to(q.dtype))
            else:
                out[rows], lse_rows = _extend(q[rows], k[rows], v[rows], read)
            if lse is not None:
                lse[rows] = lse_rows
        return out if lse is None or sinks is None else with_sinks(out, lse, sinks)

    def _decode(self, q: torch.Tensor, layer: int, meta: dict, out: torch.Tensor, lse_out: torch.Tensor | None) -> None:
        """Each decode row over its own slots, then each fork group's shared prefix merged in;
        the rows' log-sum-exps into lse_out where it is given."""
        rows, idx, p = meta["dec_rows"], meta["dec_idx"], self.pool
        b, heads, kv_heads, dim = rows.shape[0], q.shape[1], p.k[layer].shape[1], q.shape[2]
        group = heads // kv_heads
        if "dec_lens" in meta:  # the native kernel writes out[rows] itself
            want = meta["dec_groups"] or lse_out is not None  # a fork group's merge, or sinks, need it
            lse = torch.empty(b, heads) if want else None
            ks, vs = (p.k_scale[layer], p.v_scale[layer]) if p.quantized else (None, None)
            decode_attention_cpu(q, p.k[layer], p.v[layer], out, rows, idx, meta["dec_lens"], lse=lse, k_scale=ks, v_scale=vs)
            if lse is None:
                return
            if not meta["dec_groups"]:
                assert lse_out is not None
                lse_out.index_copy_(0, rows, lse)
                return
            o, lse = out.index_select(0, rows).view(b, kv_heads, group, dim), lse.view(b, kv_heads, group)
        else:
            qd = q.index_select(0, rows).view(b, kv_heads, group, dim)
            kd, vd = (x.transpose(1, 2) for x in p.read(layer, idx))  # (b, kv_heads, L, dim)
            o, lse = attention_lse(qd, kd, vd, bias=meta["dec_bias"])
        for g in meta["dec_groups"]:
            m = torch.tensor(g.members, device=q.device)
            n = len(g.members)
            qg = q.index_select(0, rows[m]).view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, n * group, dim)
            og, lg = attention_lse(qg, *_heads_first(p.read(layer, g.kv)))
            og = og.view(kv_heads, n, group, dim).transpose(0, 1)
            lg = lg.view(kv_heads, n, group).transpose(0, 1)
            merged, merged_lse = merge(o.index_select(0, m), lse.index_select(0, m), og, lg)
            o.index_copy_(0, m, merged)
            lse = lse.index_copy(0, m, merged_lse)
        out.index_copy_(0, rows, o.reshape(b, heads, dim))
        if lse_out is not None:
            lse_out.index_copy_(0, rows, lse.reshape(b, heads))


def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            prefix: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk attending causally to itself (its k/v as computed) and fully to its prefix's
    K/V rows (as the pool reads them), if it has one: its output (n, heads, dim) and log-sum-exp
    (n, heads)."""
    qe, ke, ve = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o, lse = attention_lse(qe, ke, ve, causal=True)
    if prefix is not None:
        op, lp = attention_lse(qe, *_heads_first(prefix))
        o, lse = merge(o, lse, op, lp)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def _extend_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   prefix: tuple[torch.Tensor, torch.Tensor] | None, band: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk over its (windowed) prefix and itself in one pass, under the band mask (`band_bias`:
    query i, at position P + i with P the prefix rows, sees key j where P + i - window < j <= P + i;
    every query sees itself, so no row is wholly masked), as _extend returns it."""
    if prefix is not None:
        k, v = torch.cat([prefix[0].to(k.dtype), k]), torch.cat([prefix[1].to(v.dtype), v])
    o, lse = attention_lse(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], bias=band)
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head (gpt-oss: a softmax over the keys' scores and the
    sink, the sink's share dropped) from attention without it: each row's output times
    sum exp(scores) / (sum exp(scores) + exp(sink)) = sigmoid(lse - sink). out (T, heads, dim),
    lse (T, heads) fp32, sinks (heads,)."""
    return (out.float() * torch.sigmoid(lse - sinks.float())[..., None]).to(out.dtype)


def band_bias(n: int, length: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, length) additive mask, 0 or -inf: the last n of `length` positions as queries, each
    seeing the `window` positions up to and including its own."""
    qpos = torch.arange(length - n, length, device=device)[:, None]
    kpos = torch.arange(length, device=device)[None, :]
    visible = (kpos <= qpos) & (kpos > qpos - window)
    return torch.zeros(n, length, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _heads_first(kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, kv_heads, dim) K and V rows as (1, kv_heads, L, dim) views."""
    return kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]


def _slots(slots: list[int], dev: torch.device) -> slice | torch.Tensor:
    if slots and slots[-1] - slots[0] == len(slots) - 1 and slots == list(range(slots[0], slots[-1] + 1)):
        return slice(slots[0], slots[-1] + 1)
    return torch.tensor(slots, dtype=torch.int64, device=dev)


def _fork_groups(dec: list[SeqView], owners: list[int], dev: torch.device) -> tuple[list[_Group], list[int]]:
    """Decode rows of different requests whose KV starts with the same slots (a fork off a
    cached prompt; a draft's rows are one request's). Returns the groups and, per row, how many
    leading slots its group covers."""
    by_first: dict[int, list[int]] = {}
    for i, s in enumerate(dec):
        by_first.setdefault(s.slots[0], []).append(i)
    groups, shared = [], [0] * len(dec)
    for members in by_first.values():
        if len({owners[i] for i in members}) < 2:
            continue
        head = dec[members[0]].slots
        n = min(common_prefix_len(head, dec[i].slots) for i in members[1:])
        n = min(n, min(dec[i].kv_len for i in members) - 1)  # every member keeps its own last token
        if n < MIN_SHARED:
            continue
        groups.append(_Group(members, _slots(head[:n], dev)))
        for i in members:
            shared[i] = n
    return groups, shared


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from each part's output and log-sum-exp: the
    union's output and log-sum-exp."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o.to(o1.dtype), m + torch.log(w1 + w2)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, n, D), k/v (B, KVH, L, D) with H a multiple of KVH; bias broadcastable to
    (B, H, n, L) (0 or -inf). Returns the output (B, H, n, D) and log-sum-exp (B, H, n), fp32."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        return o, lse.float()
    return plain_attention_lse(q, k, v, causal, bias)


def plain_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `attention_lse` in plain torch ops, for devices without the CPU kernel."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n, length = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, length, dtype=torch.bool, device=q.device).triu(length - n + 1), float("-inf"))
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()).to(q.dtype), lse
