"""ForwardBatch: the one tensor-side batch, built from the scheduler's plan.

Tokens of all sequences are flattened: sequence i owns rows [q_start, q_start + q_len)
and attends to KV slots `slots` (its cached prefix, then the rows being fed now).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixserve.cache.allocator import WindowTables
from radixserve.request import Req
from radixserve.sched.scheduler import SchedulePlan

if TYPE_CHECKING:
    from radixserve.attention.base import AttnBackend


MAX_ROW_EXTEND = 32  # an output extend this short (jump-forward text) attends row by row, like the decodes it replaces


@dataclass
class SeqView:
    q_start: int  # first row in the flat batch
    q_len: int  # tokens fed now
    prefix_len: int  # KV tokens before them
    slots: list[int]  # KV slots, len == prefix_len + q_len
    as_rows: bool = False  # each fed token attends as a decode row would (a draft; text jump-forward forced)
    window_slots: list[int] | None = None  # with a window pool: its slots for the last len(...) of `slots`

    @property
    def kv_len(self) -> int:
        return self.prefix_len + self.q_len

    def windowed(self, window: int) -> SeqView:
        """The view a sliding-window layer reads (`window` positions up to each query, its own
        included): without the leading slots no fed token's window reaches. A decode row keeps
        its last `window` slots; a longer chunk still needs the band mask within."""
        drop = max(0, self.prefix_len - window + 1) if window else 0
        if window and self.window_slots is not None:  # in the window pool's slots
            keep = self.kv_len - drop
            return SeqView(self.q_start, self.q_len, self.prefix_len - drop, self.window_slots[len(self.window_slots) - keep :],
                           self.as_rows)
        return self if drop == 0 else SeqView(self.q_start, self.q_len, self.prefix_len - drop, self.slots[drop:], self.as_rows)

    def rows(self) -> list[SeqView]:
        """Each fed token as a one-row view over the slots up to it (causal): a draft's rows then
        attend exactly as the decodes they stand for would."""
        w = self.window_slots
        return [SeqView(self.q_start + j, 1, self.prefix_len + j, self.slots[: self.prefix_len + j + 1], False,
                        None if w is None else w[: len(w) - (self.q_len - 1 - j)])
                for j in range(self.q_len)]


@dataclass
class NativeDecode:
    """What a fused CPU decode step (`radixserve_kernels.cpu` decode_layers) needs of the KV side: the
    pools, where each row's new K/V goes, and each row's slot table (rows read their whole
    table: no shared-prefix pass)."""

    k_pools: list[torch.Tensor]
    v_pools: list[torch.Tensor]
    out_slots: torch.Tensor
    rows: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    k_scales: list[torch.Tensor] = field(default_factory=list)  # an int8 / fp8 pool's (empty: a float pool)
    v_scales: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LoRARows:
    """A forward batch's rows grouped by LoRA adapter (models/lora.py applies them): `rows` holds
    the rows that have an adapter in adapter order, `groups` each adapter's run of it (adapter,
    first, end); `start` the first row when those rows are already in that order (one run
    from `start`: `start` None otherwise), so the torch path takes slices instead of gathering."""

    groups: list[tuple[Any, int, int]]  # (models.lora.Adapter, first, end) within `rows`
    rows: torch.Tensor  # int64
    start: int | None

    @classmethod
    def of(cls, spans: list[tuple[Any, int, int]], device: torch.device) -> LoRARows | None:
        """`spans`: (adapter or None, first row, rows) of each sequence, in row order."""
        by: dict[int, tuple[Any, list[int]]] = {}
        for adapter, start, n in spans:
            if adapter is not None:
                by.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
        if not by:
            return None
        order = [i for _, idx in by.values() for i in idx]
        groups, at = [], 0
        for adapter, idx in by.values():
            groups.append((adapter, at, at + len(idx)))
            at += len(idx)
        run = order == list(range(order[0], order[0] + len(order)))
        return cls(groups, torch.tensor(order, dtype=torch.int64, device=device), order[0] if run else None)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_slots: torch.Tensor  # (T,) int64: where each row's new K/V is written
    seqs: list[SeqView]
    attn_backend: AttnBackend
    attn_meta: dict[str, Any] = field(default_factory=dict)  # owned by the backend
    window_out_slots: torch.Tensor | None = None  # with a window pool: where the windowed layers write
    lora: LoRARows | None = None  # rows of requests with a LoRA adapter, grouped by adapter (None: none)

    def out_for(self, window: int) -> torch.Tensor:
        """Where a layer with this window (0: full attention) writes its new K/V."""
        return self.window_out_slots if window and self.window_out_slots is not None else self.out_slots

    @classmethod
    def from_plan(
        cls,
        plan: SchedulePlan,
        slots_of: Callable[[Req], list[int]],
        backend: AttnBackend,
        device: torch.device,
        window: WindowTables | None = None,
    ) -> ForwardBatch:
        """`window`: the sliding-window layers' own pool, where they have one (each sequence then
        carries the window pool's slots of the positions its queries see)."""
        ids: list[int] = []
        pos: list[int] = []
        out: list[int] = []
        wout: list[int] = []
        seqs: list[SeqView] = []
        for it in plan.items:
            end = it.start + it.length
            slots = slots_of(it.req)[:end]
            as_rows = it.spec is not None or (it.start >= it.req.prompt_len and it.length <= MAX_ROW_EXTEND)
            wslots = None
            if window is not None:
                wslots = window.slots(slots[max(0, it.start - window.reach) : end])
                wout.extend(wslots[len(wslots) - it.length :])
            seqs.append(SeqView(len(ids), it.length, it.start, slots, as_rows, wslots))
            ids.extend(it.fed_ids)
            pos.extend(range(it.start, end))
            out.extend(slots[it.start : end])

        def as_tensor(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        batch = cls(as_tensor(ids), as_tensor(pos), as_tensor(out), seqs, backend,
                    window_out_slots=as_tensor(wout) if window is not None else None)
        if any(it.req.adapter is not None for it in plan.items):
            batch.lora = LoRARows.of([(it.req.adapter, s.q_start, s.q_len) for it, s in zip(plan.items, seqs)], device)
        backend.prepare(batch)
        return batch
