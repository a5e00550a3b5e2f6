"""`--tensor-parallel N`: the engine is rank 0 of N; ranks 1..N-1 are worker processes that
hold their shard of every layer (models/tp.py) and their share of the KV heads in a pool of
their own, and follow rank 0's steps. One scheduler, one radix cache, one sampler: rank 0 plans
and allocates the KV slots (the same slot indices on every rank), sends each step's batch (the
fed tokens, their positions, each sequence's slots) to the workers, and every rank runs the
forward, whose row-parallel linears all-reduce the hidden state (gloo on CPU). Rank 0 alone
computes logits and samples.

A worker that fails to start is an error of the engine's start (its message passed back); one
that dies later ends rank 0's next collective with an error (the step fails, the engine
reports it). Imported only when N > 1: torch.distributed is never loaded on the default path.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.batch import ForwardBatch
from radixserve.models.tp import Group, Shard, ShmAllReduce, shard_model

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # a worker loads the whole model before it keeps its shard
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)  # a long prefill chunk on a slow CPU


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: the model as rank 0 loaded it, and a KV pool of the same slots."""

    path: str
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
    shm_name: str  # the shared-memory all-reduce's segment (rank 0 makes it)


def threads_per_rank(size: int) -> int:
    """Each rank's torch threads: the cores shared out (at least one each)."""
    return max(1, (os.cpu_count() or 1) // size)


class TensorParallel:
    """Rank 0's side: start the workers, join their group, send each step's batch to them."""

    def __init__(self, spec: WorkerSpec, group: Group) -> None:
        """`group`: rank 0's (its model's AllReduced layers hold it): its shared memory is made here."""
        self.spec, self.group = spec, group
        group.shm = ShmAllReduce(spec.shm_name, 0, spec.size, create=True)
        ctx = mp.get_context("spawn")
        self.ready: Any = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(spec, rank, self.ready), name=f"radixserve-tp{rank}", daemon=True)
                      for rank in range(1, spec.size)]
        for p in self.procs:
            p.start()
        try:
            dist.init_process_group("gloo", init_method=f"file://{spec.init_file}", rank=0, world_size=spec.size,
                                    timeout=COLLECTIVE_TIMEOUT)
            for _ in self.procs:
                rank, error = self.ready.get(timeout=START_TIMEOUT_S)
                if error is not None:
                    raise RuntimeError(f"tensor-parallel worker {rank} failed to start:\n{error}")
        except BaseException:
            self._kill()
            group.shm.close()
            group.shm = None
            raise
        self.closed = False

    def step(self, batch: ForwardBatch) -> None:
        """Hand this step's batch to the workers (they run the forward with rank 0)."""
        msg = [(batch.input_ids, batch.positions, batch.out_slots, batch.seqs, batch.window_out_slots)]
        dist.broadcast_object_list(msg, src=0)

    def close(self) -> None:
        """End the workers (each leaves its loop at the empty step) and the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0)
            for p in self.procs:
                p.join(timeout=30)
        finally:
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            _unlink(self.spec.init_file)
            if self.group.shm is not None:
                self.group.shm.close()
                self.group.shm = None

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def new_shm_name() -> str:
    return f"radixserve-tp-{os.getpid()}-{os.urandom(4).hex()}"


def new_init_file() -> str:
    """A fresh rendezvous file for torch.distributed's file:// init (it must not exist yet)."""
    fd, path = tempfile.mkstemp(prefix="radixserve-tp-")
    os.close(fd)
    os.unlink(path)
    return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _worker_main(spec: WorkerSpec, rank: int, ready: Any) -> None:
    """Rank r: load, shard, build the pool, then run each step rank 0 sends until the empty one."""
    torch.set_num_threads(spec.threads)
    torch.set_flush_denormal(True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{spec.init_file}", rank=rank, world_size=spec.size,
                                timeout=COLLECTIVE_TIMEOUT)
        group = Group(ShmAllReduce(spec.shm_name, rank, spec.size))
        model, backend = build_rank(spec, rank, group)
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
            ids, pos, out, seqs, wout = msg[0]
            batch = ForwardBatch(ids, pos, out, seqs, backend, window_out_slots=wout)
            backend.prepare(batch)
            model(batch)
    dist.destroy_process_group()
    if group.shm is not None:
        group.shm.close()


def build_rank(spec: WorkerSpec, rank: int, group: Group) -> tuple[Any, Any]:
    """A worker's model shard and attention backend over its own KV pool."""
    from radixserve.attention import create_backend
    from radixserve.cache.pool import KVPool
    from radixserve.models.linear import pack_linears
    from radixserve.models.loader import load_model

    device = torch.device("cpu")
    loaded = load_model(spec.path, spec.dtype, device, spec.quantization)
    part = shard(loaded.model, rank, spec.size, group)
    if spec.pack:
        pack_linears(loaded.model, spec.dtype, device)
    a = loaded.arch
    pool = KVPool(a.num_layers, spec.num_slots, part.kv_heads, a.head_dim, spec.dtype, device, spec.kv_dtype,
                  a.layer_windows, spec.window_slots)
    return loaded.model, create_backend(spec.attention_backend, pool, device)


def shard(model: Any, rank: int, size: int, group: Group) -> Shard:
    """Shard a loaded model for rank r (its all-reduces through `group`)."""
    if not hasattr(model, "model") or not hasattr(model.model, "decoder_layers"):
        raise ValueError(f"tensor_parallel: {type(model).__name__} does not shard (the Llama family does)")
    return shard_model(model, rank, size, group)
