"""One model over N processes on one machine: `--tensor-parallel N` (each rank a shard of every
layer, models/tp.py) or `--pipeline-parallel N` (each rank a stage of the layers, models/pp.py).

The engine is rank 0; ranks 1..N-1 are worker processes that build their part of the model and
a KV pool for it (their KV heads, or their layers) with the same slots, and follow rank 0's
steps. One scheduler, one radix cache, one sampler: rank 0 plans and allocates the KV slots
(the same slot indices on every rank) and sends each step's batch (the fed tokens, their
positions, each sequence's slots) to the workers. Tensor parallel: every rank runs the whole
forward on its shard, all-reducing the hidden state twice a layer. Pipeline parallel: the batch
is cut into micro-batches that flow stage to stage (gloo point-to-point), the last stage's
hidden state back to rank 0. Rank 0 alone computes logits and samples.

A worker that fails to start is an error of the engine's start (its message passed back); one
that dies later ends rank 0's next step with an error. Imported only when N > 1:
torch.distributed is never loaded on the default path.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.batch import ForwardBatch
from radixserve.models.pp import Stage, cut_model, micro_batches, run_stage
from radixserve.models.tp import Group, Shard, ShmAllReduce, shard_model

START_TIMEOUT_S = 600.0  # a worker loads the whole model before it keeps its part
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)  # a long prefill chunk on a slow CPU
TENSOR, PIPELINE = "tensor", "pipeline"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: the model as rank 0 loaded it, its part, a KV pool of the same slots."""

    mode: str  # TENSOR | PIPELINE
    path: str | None  # as the engine was given it (None: the default model)
    dtype: torch.dtype
    quantization: str
    kv_dtype: torch.dtype
    num_slots: int
    window_slots: int
    attention_backend: str
    pack: bool
    threads: int
    size: int
    init_file: str
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
        self.ready: Any = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(spec, rank, self.ready), name=f"radixserve-rank{rank}",
                                  daemon=True) for rank in range(1, spec.size)]
        for p in self.procs:
            p.start()
        self.closed = False
        try:
            dist.init_process_group("gloo", init_method=f"file://{spec.init_file}", rank=0, world_size=spec.size,
                                    timeout=COLLECTIVE_TIMEOUT)
            for _ in self.procs:
                rank, error = self.ready.get(timeout=START_TIMEOUT_S)
                if error is not None:
                    raise RuntimeError(f"{spec.mode}-parallel worker {rank} failed to start:\n{error}")
        except BaseException:
            self.close()
            raise

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states (T, hidden), the workers running their part."""
        if isinstance(self.part, Group):
            dist.broadcast_object_list([(batch.input_ids, batch.positions, batch.out_slots, batch.seqs,
                                         batch.window_out_slots)], src=0)
            return self.model(batch)
        mbs = micro_batches(batch, self.spec.size)
        dist.broadcast_object_list([mbs], src=0)
        sends = []
        for mb in mbs:
            x, residual = run_stage(self.model, _batch(mb, self.backend), None, None, self.part)
            assert residual is not None
            sends += [dist.isend(x.contiguous(), 1), dist.isend(residual.contiguous(), 1)]
        hidden = batch.input_ids.new_empty((batch.input_ids.shape[0], self.model.cfg.hidden_size), dtype=self.spec.dtype)
        at = 0
        for mb in mbs:
            rows = mb[0].shape[0]
            dist.recv(hidden[at : at + rows], self.spec.size - 1)
            at += rows
        _wait(sends)
        return hidden

    def close(self) -> None:
        """End the workers (each leaves its loop at the empty step) and the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if dist.is_initialized() and all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0)
            for p in self.procs:
                p.join(timeout=30)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
            if dist.is_initialized():
                dist.destroy_process_group()
            _unlink(self.spec.init_file)
            if isinstance(self.part, Group) and self.part.shm is not None:
                self.part.shm.close()
                self.part.shm = None


def _wait(sends: list[Any]) -> None:
    for w in sends:
        if w is not None:
            w.wait()


def _batch(mb: tuple[Any, ...], backend: Any) -> ForwardBatch:
    ids, pos, out, seqs, wout = mb
    batch = ForwardBatch(ids, pos, out, seqs, backend, window_out_slots=wout)
    backend.prepare(batch)
    return batch


def new_shm_name() -> str:
    return f"radixserve-tp-{os.getpid()}-{os.urandom(4).hex()}"


def new_init_file() -> str:
    """A fresh rendezvous file for torch.distributed's file:// init (it must not exist yet)."""
    fd, path = tempfile.mkstemp(prefix="radixserve-mp-")
    os.close(fd)
    os.unlink(path)
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _worker_main(spec: WorkerSpec, rank: int, ready: Any) -> None:
    """Rank r: load, keep its part, build its pool, then run each step rank 0 sends until the empty one."""
    torch.set_num_threads(spec.threads)
    torch.set_flush_denormal(True)
    group = None
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec.init_file}", rank=rank, world_size=spec.size,
                                timeout=COLLECTIVE_TIMEOUT)
        if spec.mode == TENSOR:
            group = Group(ShmAllReduce(spec.shm_name, rank, spec.size))
        model, backend, part = build_rank(spec, rank, group)
    except BaseException:
        ready.put((rank, traceback.format_exc()))
        return
    ready.put((rank, None))
    with torch.inference_mode():
        while True:
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                break
            if isinstance(part, Shard):
                model(_batch(msg[0], backend))
            else:
                _pipeline_step(model, backend, part, msg[0], spec.dtype)
    dist.destroy_process_group()
    if group is not None and group.shm is not None:
        group.shm.close()


def _pipeline_step(model: Any, backend: Any, s: Stage, mbs: list[tuple[Any, ...]], dtype: torch.dtype) -> None:
    """A later stage: each micro-batch from the stage before, on to the next (the last stage's
    hidden state back to rank 0)."""
    sends = []
    width = model.cfg.hidden_size
    for mb in mbs:
        rows = mb[0].shape[0]
        x, residual = torch.empty(rows, width, dtype=dtype), torch.empty(rows, width, dtype=dtype)
        dist.recv(x, s.rank - 1)
        dist.recv(residual, s.rank - 1)
        y, r = run_stage(model, _batch(mb, backend), x, residual, s)
        if s.last:
            sends.append(dist.isend(y.contiguous(), 0))
        else:
            assert r is not None
            sends += [dist.isend(y.contiguous(), s.rank + 1), dist.isend(r.contiguous(), s.rank + 1)]
    _wait(sends)


def build_rank(spec: WorkerSpec, rank: int, group: Group | None) -> tuple[Any, Any, Shard | Stage]:
    """A worker's part of the model and its attention backend over its own KV pool."""
    from radixserve.attention import create_backend
    from radixserve.cache.pool import KVPool
    from radixserve.models.linear import pack_linears
    from radixserve.models.loader import load_model

    device = torch.device("cpu")
    loaded = load_model(spec.path, spec.dtype, device, spec.quantization)
    a = loaded.arch
    part: Shard | Stage
    if group is not None:
        part = shard(loaded.model, rank, spec.size, group)
        heads, windows = part.kv_heads, a.layer_windows
    else:
        part = stage(loaded.model, rank, spec.size)
        heads, windows = a.num_kv_heads, a.layer_windows[part.lo : part.hi]
    if spec.pack:
        pack_linears(loaded.model, spec.dtype, device)
    model: Any = loaded.model
    layers = len(model.model.layers)
    pool = KVPool(layers, spec.num_slots, heads, a.head_dim, spec.dtype, device, spec.kv_dtype, windows, spec.window_slots)
    return loaded.model, create_backend(spec.attention_backend, pool, device), part
