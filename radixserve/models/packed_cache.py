"""The packed weights of a GGUF file, kept on disk after its first load: a later start maps them
instead of repacking every tensor (Qwen2.5-1.5B Q4_K_M: the 4 s repack of its 1.1 GB).

One file per GGUF file (its cache folder is keyed by the file's path, size and mtime, as its
`-meta` folder is) and per packing layout (a hash of the kernel sources that write and read the
panels: any change to them is a miss, never a misread): `<models>/<name>-<key>-packed/<layout>.bin`,
a JSON index (buffer name -> offset, shape) then each buffer, 64-byte aligned. Written once to a
temporary file and renamed, so a crash mid-write leaves no file that could be read; a file whose
size or index does not match is a miss. Mapped copy-on-write: the weights are file-backed pages of
the page cache, shared between processes that serve the same file, never written.

RADIXSERVE_PACKED_CACHE=0 turns it off (load and repack every time, write nothing).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from radixserve_kernels.threads import helper_thread

log = logging.getLogger(__name__)

MAGIC = b"RSPACK01"
ALIGN = 64
# the sources that define the packed layout (kernels/radixserve_kernels/csrc): their content is the layout's key
_LAYOUT_SOURCES = ("quant.h", "quant_linear.cpp", "kquant_linear.cpp", "common.h", "vec.h")


def enabled() -> bool:
    return os.environ.get("RADIXSERVE_PACKED_CACHE", "1") != "0"


def layout_key() -> str:
    from radixserve_kernels.cpu import CSRC

    h = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def cache_file(gguf_path: Path) -> Path:
    from radixserve.models.gguf import converted_dir

    out = converted_dir(gguf_path)
    return out.with_name(out.name + "-packed") / f"{layout_key()}.bin"


def _data_start(index_bytes: int) -> int:
    return -(-(16 + index_bytes) // ALIGN) * ALIGN


def load(path: Path) -> dict[str, torch.Tensor]:
    """The buffers of a complete cache file, mapped (empty where there is none or it is not whole)."""
    import numpy as np

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                return {}
            (length,) = struct.unpack("<Q", head[8:])
            if length > size:
                return {}
            index = json.loads(f.read(length))
        start = _data_start(length)
        spans = {name: (start + int(at), [int(d) for d in shape]) for name, (at, shape) in index.items()}
        if not spans or any(at + int(np.prod(shape)) > size for at, shape in spans.values()):
            return {}
        mapped = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable tensors, file pages
        return {name: torch.from_numpy(mapped[at:at + int(np.prod(shape))].reshape(shape)) for name, (at, shape) in spans.items()}
    except (OSError, ValueError, TypeError, AttributeError):  # no file, or not one of ours whole
        return {}


_saving: list[threading.Thread] = []


def _stale(tmp: Path) -> bool:
    """A temporary file no live writer owns: its writer's pid is gone, or it is over an hour old."""
    pid = tmp.name.removeprefix(".packed-").split("-", 1)[0]
    if pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            pass
    return time.time() - tmp.stat().st_mtime > 3600


def save_soon(path: Path, buffers: dict[str, torch.Tensor]) -> None:
    """`save` on a thread of its own, at the lowest priority: a first start is ready without
    waiting for the write (1.4 s for Qwen2.5-1.5B's 1.1 GB), and its first requests come first;
    `wait()` joins it (an engine's shutdown does)."""
    buffers = dict(buffers)

    def run() -> None:
        helper_thread()
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread alone, at the lowest priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        save(path, buffers)

    t = threading.Thread(target=run, name="radixserve-packed-cache", daemon=True)
    if not _saving:
        atexit.register(wait)  # a process leaving normally (an engine that failed to start) finishes the write
    _saving.append(t)
    t.start()


def wait() -> None:
    """Every `save_soon` write finished."""
    while _saving:
        _saving.pop().join()


def save(path: Path, buffers: dict[str, torch.Tensor]) -> None:
    """Write the buffers atomically (a temporary file in the same folder, then a rename); the
    folder's other layouts go. Failing to write is logged, never raised: the cache is optional."""
    index: dict[str, list[Any]] = {}
    at = 0
    for name, t in buffers.items():
        index[name] = [at, list(t.shape)]
        at += -(-t.numel() // ALIGN) * ALIGN
    body = json.dumps(index).encode()
    start = _data_start(len(body))
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".packed-{os.getpid()}-", dir=path.parent)  # the writer's pid: see _stale
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(body)) + body)
                for name, t in buffers.items():
                    f.seek(start + index[name][0])
                    f.write(memoryview(t.contiguous().numpy()).cast("B"))  # type: ignore[arg-type]  # numpy arrays are buffers
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for old in [*path.parent.glob("*.bin"), *path.parent.glob(".packed-*")]:  # other layouts; a dead writer's
            with contextlib.suppress(OSError):  # gone meanwhile (another process cleaning up)
                if old != path and (old.suffix == ".bin" or _stale(old)):
                    old.unlink()
    except OSError as e:
        log.warning("could not keep the packed weights in %s (%s): the next start repacks them", path, e)
