"""The channel between rank 0 and its tensor/pipeline-parallel workers (engine/model_parallel.py),
built so that another local user can neither join it nor run code through it:

- the rendezvous is torch.distributed's FileStore in a private directory (mkdtemp: ours, 0700),
  and every rank refuses one that is not;
- gloo listens on 127.0.0.1 only (a device of its own, whatever GLOO_SOCKET_IFNAME or the
  hostname say): the ranks share one machine;
- each step travels as typed msgpack bytes (msgspec) in a uint8 tensor behind a length header,
  never as a pickle: whoever got onto the channel could send wrong numbers, never code;
- a worker's start-up report is bytes on an anonymous pipe (send_bytes / recv_bytes, never the
  unpickling recv).

No torch.distributed default group is made: each rank holds its ProcessGroupGloo and calls it.
"""

from __future__ import annotations

import datetime
import os
import stat
import tempfile
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from radixserve.batch import SeqView
from radixserve.cache.disk_guard import is_private_dir

LOOPBACK = "127.0.0.1"
STORE_FILE = "store"
MAX_STEP_BYTES = 1 << 30  # a step's description (token ids, positions, slot tables) is far below this
MAX_REPORT_BYTES = 1 << 20  # a worker's start-up error (a traceback)
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SeqView], torch.Tensor | None]


# -- rendezvous -------------------------------------------------------------------------------------
def new_rendezvous() -> str:
    """The FileStore path for one group: a file (not made yet) in a fresh private directory."""
    return os.path.join(tempfile.mkdtemp(prefix="radixserve-mp-"), STORE_FILE)


def check_private(path: str) -> None:
    """Refuse a rendezvous whose directory another user could write or read (it carries the
    ranks' addresses: whoever rewrites it chooses whom the workers connect to)."""
    d = os.path.dirname(path) or "."
    st = os.lstat(d)
    if not is_private_dir(st):
        raise RuntimeError(f"model parallelism: the rendezvous directory {d} must be a directory of ours with "
                           f"mode 0700 (it is {stat.filemode(st.st_mode)}, uid {st.st_uid})")


def remove_rendezvous(path: str) -> None:
    """The store file and its private directory (left alone if something else is in it)."""
    for rm, p in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            rm(p)
        except OSError:
            pass


def join(path: str, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """This rank's gloo group, over loopback (blocks until every rank has joined)."""
    check_private(path)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the one way to bind gloo to an address
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    opts._threads = 2
    return dist.ProcessGroupGloo(dist.FileStore(path, size), rank, size, opts)


# -- steps -------------------------------------------------------------------------------------------
class _Seq(msgspec.Struct, array_like=True):
    q_start: int
    q_len: int
    prefix_len: int
    slots: list[int]
    as_rows: bool
    window_slots: list[int] | None


class _MicroBatch(msgspec.Struct, array_like=True):
    ids: bytes  # int64s, native order (the ranks share a machine)
    pos: bytes
    out: bytes
    seqs: list[_Seq]
    wout: bytes | None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[_MicroBatch])


def _raw(t: torch.Tensor) -> bytes:
    return t.to(torch.int64).contiguous().numpy().tobytes()


def _ints(b: bytes) -> torch.Tensor:
    if len(b) % 8:
        raise ValueError("a malformed step: an int64 array of a partial length")
    return torch.frombuffer(bytearray(b), dtype=torch.int64) if b else torch.empty(0, dtype=torch.int64)


def encode_step(mbs: list[MicroBatch]) -> bytearray:
    """A step (its micro-batches: one for tensor parallelism) as bytes."""
    msg = [_MicroBatch(_raw(ids), _raw(pos), _raw(out),
                       [_Seq(s.q_start, s.q_len, s.prefix_len, s.slots, s.as_rows, s.window_slots) for s in seqs],
                       None if wout is None else _raw(wout))
           for ids, pos, out, seqs, wout in mbs]
    buf = bytearray()
    _encoder.encode_into(msg, buf)
    return buf


def decode_step(data: Any) -> list[MicroBatch]:
    """The micro-batches of encode_step's bytes; ValueError (msgspec's errors are ValueErrors)
    for bytes that are not a well-formed step."""
    out: list[MicroBatch] = []
    for mb in _decoder.decode(data):
        ids, pos, slots = _ints(mb.ids), _ints(mb.pos), _ints(mb.out)
        wout = None if mb.wout is None else _ints(mb.wout)
        rows = ids.numel()
        if pos.numel() != rows or slots.numel() != rows or (wout is not None and wout.numel() != rows):
            raise ValueError("a malformed step: its row arrays differ in length")
        seqs = [SeqView(s.q_start, s.q_len, s.prefix_len, s.slots, s.as_rows, s.window_slots) for s in mb.seqs]
        if any(s.q_start < 0 or s.q_len < 0 or s.q_start + s.q_len > rows or len(s.slots) != s.kv_len for s in seqs):
            raise ValueError("a malformed step: a sequence outside its rows or slots")
        out.append((ids, pos, slots, seqs, wout))
    return out


def send_step(pg: Any, data: bytearray | None) -> None:
    """Rank 0: broadcast a step's bytes (None: the empty step, which ends the workers)."""
    n = 0 if data is None else len(data)
    if n > MAX_STEP_BYTES:
        raise RuntimeError(f"model parallelism: a step of {n} bytes is over the channel's {MAX_STEP_BYTES}")
    pg.broadcast(torch.tensor([n], dtype=torch.int64), 0).wait()
    if data:
        pg.broadcast(torch.frombuffer(data, dtype=torch.uint8), 0).wait()


def recv_step(pg: Any) -> memoryview | None:
    """A worker: the next step's bytes from rank 0 (None: the empty step)."""
    head = torch.zeros(1, dtype=torch.int64)
    pg.broadcast(head, 0).wait()
    n = int(head.item())
    if n == 0:
        return None
    if not 0 < n <= MAX_STEP_BYTES:
        raise RuntimeError(f"model parallelism: a step header of {n} bytes (over {MAX_STEP_BYTES}, or negative)")
    buf = torch.empty(n, dtype=torch.uint8)
    pg.broadcast(buf, 0).wait()
    return buf.numpy().data


# -- start-up reports ---------------------------------------------------------------------------------
def report(conn: Any, error: str | None) -> None:
    """A worker: ready (error None), or why it is not."""
    conn.send_bytes(b"" if error is None else (error[-MAX_REPORT_BYTES // 4 :] or "failed").encode("utf-8", "replace"))
    conn.close()


def wait_reports(conns: list[Any], procs: list[Any], timeout_s: float, mode: str) -> None:
    """Rank 0: every worker's report (conns[i] is rank i + 1's); raises with the first failure."""
    deadline = time.monotonic() + timeout_s
    for rank, (conn, proc) in enumerate(zip(conns, procs), 1):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"{mode}-parallel worker {rank} did not start within {timeout_s:g} s")
        try:
            msg = conn.recv_bytes(MAX_REPORT_BYTES)
        except EOFError:
            proc.join(timeout=5)
            raise RuntimeError(f"{mode}-parallel worker {rank} exited (code {proc.exitcode}) before it started") from None
        if msg:
            raise RuntimeError(f"{mode}-parallel worker {rank} failed to start:\n{msg.decode('utf-8', 'replace')}")
