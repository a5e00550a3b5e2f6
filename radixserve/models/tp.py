"""Tensor parallelism for the Llama family (`--tensor-parallel N`): rank r of N holds

- a column shard of q/k/v: its KV heads (split as evenly as they go: 3 KV heads over 2 ranks
  are 2 and 1) and the query heads that read them, and a row shard of o_proj over those heads;
- a column shard of gate/up (its slice of the intermediate size) and a row shard of down_proj;
- the embedding, every norm and the head whole.

o_proj and down_proj each give a partial sum of the hidden state; `AllReduced` sums the ranks'
partials (through shared memory on one machine, else the ranks' gloo group) so every
rank ends each layer with the whole hidden state, and rank 0 alone turns the last one into logits. A bias of a row-parallel linear is
added once, by rank 0. Float weights only: a GGUF file's quantized linears (blocks along the
input features) do not shard yet, and the fused decode step runs all layers in one native call
without a place for the all-reduce, so a sharded model runs layer by layer.

Exactness: each rank's matmuls are the unsharded ones restricted to its rows or columns; what
differs is the order of the sum over the input features of o_proj and down_proj (each rank
sums its part, then the parts are added), so in fp32 the logits match to rounding (about 1e-6
relative) and greedy tokens match wherever the top two logits are further apart than that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Shard:
    """Rank r's part of a model split N ways: its KV heads [kv_lo, kv_hi) (with the query heads
    of their groups) and its slice [inter_lo, inter_hi) of the MLP's intermediate size (with
    --expert-parallel: every KV head, and its experts [inter_lo, inter_hi) of each routed layer)."""

    rank: int
    size: int
    kv_lo: int
    kv_hi: int
    inter_lo: int
    inter_hi: int

    @classmethod
    def of(cls, rank: int, size: int, kv_heads: int, intermediate: int) -> Shard:
        if kv_heads < size:
            raise ValueError(f"tensor_parallel: {size} ranks, but the model has {kv_heads} KV heads; "
                             f"each rank needs at least one (use at most {kv_heads})")
        kv = split_evenly(kv_heads, size)
        inter = split_evenly(intermediate, size)
        return cls(rank, size, kv[rank], kv[rank + 1], inter[rank], inter[rank + 1])

    @property
    def kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo


def split_evenly(n: int, parts: int) -> list[int]:
    """Bounds of n split into `parts` runs as even as they go (the first ones one longer)."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class ShmAllReduce:
    """The ranks of one machine summing through shared memory (as vLLM's and SGLang's CPU
    backends do), instead of gloo's loopback TCP: each rank copies its partial into its slot,
    raises its flag to the call's epoch, waits for every flag, and sums the slots in rank order
    (so every rank gets the same bits). Two buffers alternate by epoch: a rank that runs ahead
    writes the other one, and cannot get two ahead (it waits for everyone's flag). A tensor
    larger than a slot goes through gloo. Stores are seen in program order on x86 (TSO): the
    flag is raised after the copy."""

    SLOT_BYTES = 8 << 20  # per rank and buffer: 3,600 rows of a 576-wide fp32 hidden state
    FLAG_STRIDE = 8  # int64s: each rank's flag on its own cache line

    def __init__(self, name: str, rank: int, size: int, create: bool = False, timeout_s: float = 600.0) -> None:
        from multiprocessing import shared_memory

        head = size * self.FLAG_STRIDE * 8
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=head + 2 * size * self.SLOT_BYTES)
        buf = self.shm.buf
        assert buf is not None
        if create:
            buf[:head] = bytes(head)
        self.flags = buf[:head].cast("q")
        self.raw = torch.frombuffer(buf, dtype=torch.uint8, offset=head,
                                    count=2 * size * self.SLOT_BYTES).view(2, size, self.SLOT_BYTES)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.epoch = 0
        self.owner = create

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum x over the ranks in place; False (nothing done) when it does not fit a slot."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.SLOT_BYTES:
            return False
        self.epoch += 1
        buf = self.raw[self.epoch & 1, :, :nbytes].view(x.dtype)
        buf[self.rank].copy_(x.reshape(-1))
        self.flags[self.rank * self.FLAG_STRIDE] = self.epoch
        self._wait()
        torch.sum(buf, dim=0, out=x.view(-1))
        return True

    def _wait(self) -> None:
        flags, e, stride = self.flags, self.epoch, self.FLAG_STRIDE
        spins, deadline = 0, 0.0
        for r in range(self.size):
            while flags[r * stride] < e:
                spins += 1
                if spins & 0xFFFF == 0:  # now and then: a rank that died never raises its flag
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(f"tensor parallelism: rank {r} did not reach all-reduce {e} within "
                                           f"{self.timeout_s:g} s (it died or hangs)")

    def close(self) -> None:
        del self.raw
        self.flags.release()
        self.shm.close()
        if self.owner:
            self.shm.unlink()


@dataclass
class Group:
    """The ranks' process group as a layer sees it: an all-reduce (sum), through shared memory
    where the ranks share a machine and the tensor fits (`shm`), else the ranks' gloo group
    (`pg`, a ProcessGroupGloo: engine/parallel_channel.py); timed for bench tp."""

    shm: ShmAllReduce | None = None
    seconds: float = 0.0  # time spent in all-reduces, while timed
    timed: bool = False
    pg: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter() if self.timed else 0.0
        if self.shm is None or not self.shm(x):
            if self.pg is None:
                raise RuntimeError("tensor parallelism: an all-reduce without the ranks' group (closed?)")
            self.pg.allreduce([x]).wait()
        if self.timed:
            self.seconds += time.perf_counter() - t0
        return x


class AllReduced(nn.Module):
    """A row-parallel linear: this rank's partial sum, summed over the ranks."""

    def __init__(self, linear: nn.Module, group: Group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.group.all_reduce(y.contiguous())


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None and out.bias is not None:
            out.bias.copy_(bias)
    return out


@torch.no_grad()
def shard_model(model: Any, rank: int, size: int, group: Group) -> Shard:
    """Cut a loaded LlamaForCausalLM (plain float linears, before packing) down to rank r's
    shard, in place; returns the shard (its KV heads size the rank's KV pool)."""
    cfg = model.cfg
    if cfg.moe_layers:
        raise ValueError("tensor_parallel: a mixture-of-experts model's routed layers do not split yet; "
                         "use --pipeline-parallel (whole layers per rank)")
    shard = Shard.of(rank, size, cfg.num_kv_heads, cfg.intermediate_size)
    per_group = cfg.num_heads // cfg.num_kv_heads
    d = cfg.head_dim
    q_rows = slice(shard.kv_lo * per_group * d, shard.kv_hi * per_group * d)
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if type(m) is not nn.Linear:
                raise ValueError(f"tensor_parallel: shards float weights only, and this model's linears are "
                                 f"{type(m).__name__} (a quantized GGUF's blocks do not shard yet: load it with "
                                 f"--quantization none)")
        q, kv = attn.q_size, attn.kv_size
        k_rows = slice(q + shard.kv_lo * d, q + shard.kv_hi * d)
        v_rows = slice(q + kv + shard.kv_lo * d, q + kv + shard.kv_hi * d)
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        attn.qkv_proj = _linear(torch.cat([w[q_rows], w[k_rows], w[v_rows]]),
                                None if b is None else torch.cat([b[q_rows], b[k_rows], b[v_rows]]))
        attn.o_proj = AllReduced(_linear(attn.o_proj.weight[:, q_rows], attn.o_proj.bias if rank == 0 else None), group)
        attn.heads, attn.kv_heads = shard.kv_heads * per_group, shard.kv_heads
        attn.q_size, attn.kv_size = attn.heads * d, attn.kv_heads * d
        inter = mlp.inter
        g = slice(shard.inter_lo, shard.inter_hi)
        u = slice(inter + shard.inter_lo, inter + shard.inter_hi)
        w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        mlp.gate_up_proj = _linear(torch.cat([w[g], w[u]]), None if b is None else torch.cat([b[g], b[u]]))
        mlp.down_proj = AllReduced(_linear(mlp.down_proj.weight[:, g], mlp.down_proj.bias if rank == 0 else None), group)
        mlp.inter = shard.inter_hi - shard.inter_lo
    return shard
