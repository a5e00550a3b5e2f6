"""The KV cache's disk tier, between the pool and cache/disk.DiskStore's files.

Write-through (SGLang HiCache's write_through policy, LMCache's store on prefill): once a
request's prompt is computed, and again when it finishes (its answer is the next turn's
prompt), its whole blocks that the store lacks are copied out of the pool
on the engine thread (a gather: tens of milliseconds for thousands of tokens) and written by a
writer thread. A prompt's blocks are therefore on disk before the pool can evict them, and stay
there through a crash: eviction from the pool costs nothing, and the store is what a restarted
server finds.

Loads overlap the wait in the queue: a new request whose prompt continues past what the pool
holds, in blocks the store has, waits outside the scheduler (`fetch`) while a reader thread
reads and checks them; the loop then puts them back into the pool (`put_back`, through
CacheManager.adopt) and queues the request, which the prefix cache then serves as any hit. No
step ever waits on the disk. A block that is missing or does not check out ends the chain there:
the request computes the rest.

What is a block's KV: every layer's K and V rows for its tokens (and their scales in an int8 or
fp8 pool), tensor after tensor, as the pool stores them. The model's fingerprint (the SHA-256 of
each of its files, whole, remembered per file version: models.files.file_digest; its architecture, the
activations' and the pool's dtypes) is part of every key, so a block is only ever read back into
the pool that wrote it, or one alike.

Gathered blocks wait for the writer in host memory: at most `pending_budget(pool)` bytes (half
the pool's bytes, at most 1 GiB); past it a prompt's further blocks are not written (counted in
`skipped_tokens`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from radixserve.cache.disk import DiskStore, block_keys
from radixserve.cache.disk_guard import load_key, private_dir
from radixserve.cache.events import BlockEvents, chain, namespace_key
from radixserve.cache.pool import KVPool
from radixserve.cache.prefix import Namespace
from radixserve.config import CacheConfig
from radixserve.models.files import file_digest
from radixserve.models.gguf import cache_root
from radixserve.request import FinishReason, Req
from radixserve.sched.cache_manager import CacheManager
from radixserve_kernels.threads import helper_thread

log = logging.getLogger(__name__)

KV_FORMAT = 1  # what a block's payload is; a new layout gets a new number (and so new keys)
PENDING_SHARE, MAX_PENDING_BYTES = 0.5, 1 << 30  # gathered blocks waiting for the writer: of the pool's bytes, at most
READ_THREADS = 4  # blocks read (and checked) at once: file reads and HMAC-SHA256 release the GIL
KEY_ENV = "RADIXSERVE_KV_DISK_KEY"  # the blocks' signing key (hex), else a key file in the radixserve cache dir


def open_tier(c: CacheConfig, pool: KVPool, model_path: Path, facts: list[Any]) -> KVTier:
    """The disk tier on `c.kv_disk_dir` (checked private, locked, its blocks signed) for this
    model; a ValueError naming what is wrong."""
    assert c.kv_disk_dir is not None
    fingerprint = model_fingerprint(model_path, facts)
    root = private_dir(c.kv_disk_dir)
    store = DiskStore(root, int(c.kv_disk_gb * 1e9), c.kv_disk_block_tokens, dict(c.tenant_max_cached_tokens),
                      key=disk_key(root))
    return KVTier(store, pool, fingerprint)


def disk_key(root: Path) -> bytes:
    """The key that signs the tier's blocks: $RADIXSERVE_KV_DISK_KEY (hex, 16 bytes or more), else
    the key file `kv-disk.key` in the radixserve cache dir (made once, 0600), never inside the
    tier's directory (whoever could write blocks there could then sign them)."""
    given = os.environ.get(KEY_ENV)
    if given:
        try:
            key = bytes.fromhex(given)
        except ValueError:
            raise ValueError(f"{KEY_ENV}: not a hex string") from None
        if len(key) < 16:
            raise ValueError(f"{KEY_ENV}: {len(key)} bytes; give at least 16 (32 hex digits)")
        return key
    file = cache_root() / "kv-disk.key"
    if file.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"kv_disk_dir: the disk tier's key file {file} would lie inside {root}; give a directory "
                         "outside the radixserve cache dir (RADIXSERVE_CACHE_DIR)")
    return load_key(file)


def pending_budget(pool: KVPool) -> int:
    return int(min(pool.nbytes * PENDING_SHARE, MAX_PENDING_BYTES))


def model_fingerprint(path: Path, facts: list[Any]) -> str:
    """What the KV of a token depends on besides the tokens: the weights (every file's name and
    the digest of its whole content), and `facts` (the architecture, dtypes, quantization)."""
    h = hashlib.sha256(json.dumps([KV_FORMAT, *map(str, facts)]).encode())
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".json", ".bin"))
    for f in files:
        h.update(f"{f.name}:{file_digest(f)}".encode())
    return h.hexdigest()[:32]


class KVTier:
    def __init__(self, store: DiskStore, pool: KVPool, fingerprint: str, max_pending_bytes: int | None = None) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.block = store.block_tokens
        self.pool = pool
        self.block_bytes = self.block * pool.row_bytes  # a block's payload: pool.gather of its slots
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # keys gathered, not yet written
        self._pending_bytes = 0
        self.max_pending_bytes = max(self.block_bytes, pending_budget(pool) if max_pending_bytes is None else max_pending_bytes)
        self._writes: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="radixserve-kv-disk-write", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="radixserve-kv-disk-load", initializer=helper_thread)
        self._blocks = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="radixserve-kv-disk-read",
                                          initializer=helper_thread)
        self.written_tokens = 0  # tokens written to the store
        self.skipped_tokens = 0  # tokens not written: the writer was too far behind, or the store had no room
        self.loaded_tokens = 0  # tokens put back into the pool from the store
        self.events: BlockEvents | None = None

    def tell(self, events: BlockEvents) -> None:
        """Tell the blocks written and removed as KV events (cache/events.py; medium DISK)."""
        self.events = events
        self.store.on_removed = events.disk_removed

    # -- keys -------------------------------------------------------------------------------
    def keys(self, req: Req, upto: int | None = None) -> list[str]:
        """The keys of the whole blocks of the request's first `upto` tokens (default: its prompt)."""
        n = req.prompt_len if upto is None else upto
        return block_keys(self.fingerprint, CacheManager.namespace(req), req.token_ids[:n], self.block)

    # -- writing (engine thread, then the writer) -------------------------------------------
    def save(self, req: Req, slots: list[int], upto: int | None = None) -> None:
        """The request's first `upto` tokens (default: its prompt) are computed, their KV in
        `slots`: write their whole blocks that the store lacks; a retained request's blocks (of
        its retained prompt tokens) are kept until its retention ends."""
        b, ns, retained = self.block, CacheManager.namespace(req), req.retained_tokens
        keys = self.keys(req, upto)
        told = self._told(ns, req.token_ids[: len(keys) * b])
        for i, key in enumerate(keys):
            until = req.retain_until if i * b < retained else 0.0
            with self._lock:
                if key in self._pending or self.store.has(key):
                    if until:
                        self._writes.put(("retain", key, until))
                    if told is not None and self.events is not None and key not in self._pending \
                            and not self.events.has_disk(key):
                        self._writes.put(("tell", key, told(i)))  # e.g. found on disk at the start
                    continue
                if self._pending_bytes + self.block_bytes > self.max_pending_bytes:
                    self.skipped_tokens += b
                    continue
                self._pending.add(key)
                self._pending_bytes += self.block_bytes
            payload = self.pool.gather(slots[i * b : (i + 1) * b])
            self._writes.put(("put", key, ns, req.token_ids[i * b : (i + 1) * b], payload, until,
                              told(i) if told is not None else None))

    def _told(self, ns: Namespace, tokens: list[int]) -> Callable[[int], tuple[Any, ...]] | None:
        """With KV events: disk block i's event blocks (hashes, parent, tokens, namespace key), the
        prompt's chain hashed at the first block that needs telling (most saves need none)."""
        if self.events is None:
            return None
        e, key = self.events.block_size, namespace_key(ns)
        k = self.block // e

        @functools.cache
        def hashes() -> list[int]:
            return chain(None, key, tokens, e)

        def told(i: int) -> tuple[Any, ...]:
            h = hashes()
            return h[i * k : (i + 1) * k], h[i * k - 1] if i else None, tokens[i * self.block : (i + 1) * self.block], key

        return told

    def _write_loop(self) -> None:
        helper_thread()
        while (job := self._writes.get()) is not None:
            try:
                if job[0] == "retain":
                    self.store.retain(job[1], job[2])
                    continue
                if job[0] == "tell":
                    if self.events is not None and self.store.has(job[1]):
                        self.events.disk_stored(job[1], *job[2])
                    continue
                _, key, ns, tokens, payload, until, told = job
                try:
                    ok = self.store.put(key, ns, self.fingerprint, tokens, memoryview(payload.numpy()), until)
                finally:
                    with self._lock:
                        self._pending.discard(key)
                        self._pending_bytes -= self.block_bytes
                if ok and told is not None and self.events is not None:
                    self.events.disk_stored(key, *told)
                    if not self.store.has(key):  # a reader found it bad meanwhile (its removal found nothing to tell)
                        self.events.disk_removed(key)
                with self._lock:
                    if ok:
                        self.written_tokens += len(tokens)
                    else:
                        self.skipped_tokens += len(tokens)
            except Exception:
                log.exception("KV disk tier: a write failed (the block is a miss)")
            finally:
                self._writes.task_done()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every gathered block is written (a graceful shutdown); False on timeout."""
        done = threading.Event()

        def wait() -> None:
            self._writes.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    # -- loading (engine thread, the reader, then the engine thread) ------------------------
    def fetch(self, req: Req, cache: CacheManager, done: Callable[[int, list[memoryview]], None]) -> bool:
        """If the store holds blocks of the request's prompt past what the pool holds, read them
        on the reader thread (then `done(first block, payloads)`, from there) and return True:
        the request waits outside the scheduler until `put_back`."""
        keys = self.keys(req)
        n = self.store.hits(keys)
        if n == 0 or n <= (first := cache.match_len(req) // self.block):
            return False
        ns = CacheManager.namespace(req)
        tokens = req.token_ids[: n * self.block]

        def block(i: int) -> memoryview | None:
            return self.store.get(keys[i], ns, self.fingerprint, tokens[i * self.block : (i + 1) * self.block],
                                  self.block_bytes)

        def read() -> None:
            t0 = time.perf_counter()
            got: list[memoryview] = []
            try:
                for payload in self._blocks.map(block, range(first, n)):  # in order: the chain ends at a miss
                    if payload is None:
                        break
                    got.append(payload)
            except Exception:
                log.exception("KV disk tier: a read failed (a miss)")
            log.debug("KV disk tier: %s: read %d blocks in %.1f ms", req.rid, len(got), (time.perf_counter() - t0) * 1e3)
            done(first, got)

        self._reader.submit(read)
        return True

    def put_back(self, req: Req, cache: CacheManager, first: int, payloads: list[memoryview]) -> None:
        """The blocks read for the request (from block `first`) go into the pool and the prefix
        cache (if there is room: else it computes them), held for it until it is admitted."""
        if not payloads or req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            return
        b = self.block
        start, upto = first * b, (first + len(payloads)) * b

        def fill(at: int, slots: list[int]) -> None:
            for j, payload in enumerate(payloads):
                lo, hi = max(at, start + j * b), start + (j + 1) * b
                if lo >= hi:
                    continue
                self.pool.scatter(torch.frombuffer(payload, dtype=torch.uint8), b, slots[lo - at : hi - at],
                                  lo - start - j * b)

        t0 = time.perf_counter()
        req.disk_tokens = cache.adopt(req, upto, fill, have_from=start)
        self.loaded_tokens += req.disk_tokens
        log.debug("KV disk tier: %s: %d tokens put back in %.1f ms", req.rid, req.disk_tokens, (time.perf_counter() - t0) * 1e3)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the writes under way (a restart then finds them), stop both threads."""
        if not self.flush():
            log.warning("KV disk tier: writes still pending at shutdown were left (their blocks are misses)")
        self._writes.put(None)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._blocks.shutdown(wait=True, cancel_futures=True)
        self._writer.join(5)
        self.store.close()

    def stats(self) -> dict[str, int]:
        return {"kv_disk_blocks": self.store.num_blocks, "kv_disk_bytes": self.store.num_bytes,
                "kv_disk_capacity_bytes": self.store.capacity, "kv_disk_written_tokens": self.written_tokens,
                "kv_disk_skipped_tokens": self.skipped_tokens,
                "kv_disk_loaded_tokens": self.loaded_tokens, "kv_disk_corrupt_blocks": self.store.corrupt}
