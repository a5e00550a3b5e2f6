"""One model over N processes on one machine: `--tensor-parallel N` (each rank a shard of every
layer, models/tp.py), `--pipeline-parallel N` (each rank a stage of the layers, models/pp.py) or
`--expert-parallel N` (each rank the whole model but for the experts: its share of each routed
layer's, the layer's output all-reduced as tensor parallelism's row-parallel linears are;
models/moe.py `MoE.keep_experts`).

The engine is rank 0; ranks 1..N-1 are worker processes that build their part of the model and
a KV pool for it (their KV heads, or their layers) with the same slots, and follow rank 0's
steps. One scheduler, one radix cache, one sampler: rank 0 plans and allocates the KV slots
(the same slot indices on every rank) and sends each step's batch (the fed tokens, their
positions, each sequence's slots) to the workers. Tensor parallel: every rank runs the whole
forward on its shard, all-reducing the hidden state twice a layer. Pipeline parallel: the batch
is cut into micro-batches that flow stage to stage (gloo point-to-point), the last stage's
hidden state back to rank 0. Rank 0 alone computes logits and samples.

A worker that fails to start is an error of the engine's start (its message passed back); one
that dies later ends rank 0's next step with an error. The ranks talk over engine/parallel_channel.py
(a private rendezvous, loopback gloo, steps as bytes: no pickle crosses it). Imported only when
N > 1: torch.distributed is never loaded on the default path.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import secrets
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.batch import ForwardBatch
from radixserve.engine import parallel_channel as channel
from radixserve.models.pp import Stage, cut_model, micro_batches, run_stage
from radixserve.models.tp import Group, Shard, ShmAllReduce, shard_model

START_TIMEOUT_S = 600.0  # a worker loads the whole model before it keeps its part
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)  # a long prefill chunk on a slow CPU
TENSOR, PIPELINE, EXPERT = "tensor", "pipeline", "expert"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: the model as rank 0 loaded it, its part, a KV pool of the same slots."""

    mode: str  # TENSOR | PIPELINE | EXPERT
    path: str | None  # as the engine was given it (None: the default model)
    dtype: torch.dtype
    quantization: str
    activations: str  # --activations, as rank 0 took it
    kv_dtype: torch.dtype
    num_slots: int
    window_slots: int
    attention_backend: str
    pack: bool
    threads: int
    size: int
    init_file: str  # the rendezvous (new_init_file: in a private directory)
    shm_name: str  # tensor parallel: the shared-memory all-reduce's segment (rank 0 makes it); else ""


def threads_per_rank(size: int) -> int:
    """Each rank's torch threads: the cores shared out (at least one each)."""
    return max(1, (os.cpu_count() or 1) // size)


def check_model(model: Any, mode: str) -> None:
    if not hasattr(model, "model") or not hasattr(model.model, "decoder_layers"):
        raise ValueError(f"{mode}_parallel: {type(model).__name__} does not split (the Llama family does)")


def shard(model: Any, rank: int, size: int, group: Group) -> Shard:
    """Cut a loaded model to rank r's tensor-parallel shard (its all-reduces through `group`)."""
    check_model(model, TENSOR)
    return shard_model(model, rank, size, group)


def shard_experts(model: Any, rank: int, size: int, group: Group) -> Shard:
    """Keep rank r's experts of every routed layer (an even share: `size` must divide the
    experts); the rank keeps every KV head (its pool is the whole model's)."""
    from radixserve.models.moe import MoE

    check_model(model, EXPERT)
    cfg = model.cfg
    if not cfg.moe_layers:
        raise ValueError(f"expert_parallel: {cfg.architecture} has no experts to split (a mixture of experts does)")
    if cfg.num_experts % size:
        raise ValueError(f"expert_parallel: {size} ranks do not divide the model's {cfg.num_experts} experts evenly")
    for layer in model.model.decoder_layers():
        if isinstance(layer.mlp, MoE):
            layer.mlp.keep_experts(rank, size, group)
    return Shard(rank, size, 0, cfg.num_kv_heads, rank * cfg.num_experts // size, (rank + 1) * cfg.num_experts // size)


def stage(model: Any, rank: int, size: int) -> Stage:
    """Cut a loaded model to rank r's pipeline stage."""
    check_model(model, PIPELINE)
    s = Stage.of(rank, size, len(model.model.layers))
    cut_model(model, s)
    return s


class ModelParallel:
    """Rank 0's side: start the workers, join their group, run each step's forward with them."""

    def __init__(self, spec: WorkerSpec, model: Any, backend: Any, part: Group | Stage) -> None:
        """`part`: rank 0's tensor-parallel group (its model's AllReduced layers hold it; its
        shared memory is made here) or pipeline stage."""
        self.spec, self.model, self.backend, self.part = spec, model, backend, part
        if isinstance(part, Group):
            part.shm = ShmAllReduce(spec.shm_name, 0, spec.size, create=True)
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, spec.size)]
        self.procs = [ctx.Process(target=_worker_main, args=(spec, rank, w), name=f"radixserve-rank{rank}", daemon=True)
                      for rank, (_, w) in enumerate(pipes, 1)]
        self.pg: Any = None
        self.closed = False
        try:
            for p in self.procs:
                p.start()
            for _, w in pipes:
                w.close()  # the worker's end: a worker gone before its report is then an EOF
            self.pg = channel.join(spec.init_file, 0, spec.size, COLLECTIVE_TIMEOUT)
            if isinstance(part, Group):
                part.pg = self.pg
            channel.wait_reports([r for r, _ in pipes], self.procs, START_TIMEOUT_S, spec.mode)
        except BaseException:
            self.close()
            raise
        finally:
            for r, _ in pipes:
                r.close()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states (T, hidden), the workers running their part."""
        pg = self.pg
        if isinstance(self.part, Group):
            channel.send_step(pg, channel.encode_step([(batch.input_ids, batch.positions, batch.out_slots, batch.seqs,
                                                        batch.window_out_slots)]))
            return self.model(batch)
        mbs = micro_batches(batch, self.spec.size)
        channel.send_step(pg, channel.encode_step(mbs))
        sends = []
        for mb in mbs:
            x, residual = run_stage(self.model, _batch(mb, self.backend), None, None, self.part)
            assert residual is not None
            sends += [_send(pg, x, 1), _send(pg, residual, 1)]
        hidden = batch.input_ids.new_empty((batch.input_ids.shape[0], self.model.cfg.hidden_size), dtype=self.spec.dtype)
        at = 0
        for mb in mbs:
            rows = mb[0].shape[0]
            _recv(pg, hidden[at : at + rows], self.spec.size - 1)
            at += rows
        _wait(sends)
        return hidden

    def close(self) -> None:
        """End the workers (each leaves its loop at the empty step) and the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.pg is not None and all(p.is_alive() for p in self.procs):
                channel.send_step(self.pg, None)
            for p in self.procs:
                if p.pid is not None:
                    p.join(timeout=30)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            self.pg = None
            channel.remove_rendezvous(self.spec.init_file)
            if isinstance(self.part, Group):
                self.part.pg = None
                if self.part.shm is not None:
                    self.part.shm.close()
                    self.part.shm = None


def _wait(sends: list[Any]) -> None:
    for w in sends:
        w.wait()


def _send(pg: Any, x: torch.Tensor, dst: int) -> Any:
    return pg.send([x.contiguous()], dst, 0)


def _recv(pg: Any, into: torch.Tensor, src: int) -> None:
    pg.recv([into], src, 0).wait()


def _batch(mb: tuple[Any, ...], backend: Any) -> ForwardBatch:
    ids, pos, out, seqs, wout = mb
    batch = ForwardBatch(ids, pos, out, seqs, backend, window_out_slots=wout)
    backend.prepare(batch)
    return batch


def new_shm_name() -> str:
    """The all-reduce segment's name: 128 random bits (rank 0 makes it O_EXCL, 0600)."""
    return f"radixserve-tp-{secrets.token_hex(16)}"


def new_init_file() -> str:
    """A fresh rendezvous (it must not exist yet), in a private directory close() removes."""
    return channel.new_rendezvous()


def _worker_main(spec: WorkerSpec, rank: int, ready: Any) -> None:
    """Rank r: load, keep its part, build its pool, then run each step rank 0 sends until the empty one."""
    torch.set_num_threads(spec.threads)
    torch.set_flush_denormal(True)
    group = None
    try:
        pg = channel.join(spec.init_file, rank, spec.size, COLLECTIVE_TIMEOUT)
        if spec.mode in (TENSOR, EXPERT):
            group = Group(ShmAllReduce(spec.shm_name, rank, spec.size), pg=pg)
        model, backend, part = build_rank(spec, rank, group)
    except BaseException:
        channel.report(ready, traceback.format_exc())
        return
    channel.report(ready, None)
    with torch.inference_mode():
        while (data := channel.recv_step(pg)) is not None:
            mbs = channel.decode_step(data)
            if isinstance(part, Shard):
                model(_batch(mbs[0], backend))
            else:
                _pipeline_step(pg, model, backend, part, mbs, spec.dtype)
    if group is not None and group.shm is not None:
        group.shm.close()


def _pipeline_step(pg: Any, model: Any, backend: Any, s: Stage, mbs: list[channel.MicroBatch], dtype: torch.dtype) -> None:
    """A later stage: each micro-batch from the stage before, on to the next (the last stage's
    hidden state back to rank 0)."""
    sends = []
    width = model.cfg.hidden_size
    for mb in mbs:
        rows = mb[0].shape[0]
        x, residual = torch.empty(rows, width, dtype=dtype), torch.empty(rows, width, dtype=dtype)
        _recv(pg, x, s.rank - 1)
        _recv(pg, residual, s.rank - 1)
        y, r = run_stage(model, _batch(mb, backend), x, residual, s)
        if s.last:
            sends.append(_send(pg, y, 0))
        else:
            assert r is not None
            sends += [_send(pg, y, s.rank + 1), _send(pg, r, s.rank + 1)]
    _wait(sends)


def build_rank(spec: WorkerSpec, rank: int, group: Group | None) -> tuple[Any, Any, Shard | Stage]:
    """A worker's part of the model and its attention backend over its own KV pool."""
    from radixserve.attention import create_backend
    from radixserve.cache.pool import KVPool
    from radixserve.models.linear import pack_linears
    from radixserve.models.loader import load_model
    from radixserve.models.quant import set_activations

    device = torch.device("cpu")
    loaded = load_model(spec.path, spec.dtype, device, spec.quantization)
    set_activations(loaded.model, spec.activations)
    a = loaded.arch
    part: Shard | Stage
    if group is not None:
        part = (shard_experts if spec.mode == EXPERT else shard)(loaded.model, rank, spec.size, group)
        heads, windows = part.kv_heads, a.layer_windows
    else:
        part = stage(loaded.model, rank, spec.size)
        heads, windows = a.num_kv_heads, a.layer_windows[part.lo : part.hi]
    if spec.pack:
        pack_linears(loaded.model, spec.dtype, device)
    model: Any = loaded.model
    layers = len(model.model.layers)
    pool = KVPool(layers, spec.num_slots, heads, a.head_dim, spec.dtype, device, spec.kv_dtype, windows, spec.window_slots)
    return loaded.model, create_backend(spec.attention_backend, pool, device, a.attn_sinks), part
