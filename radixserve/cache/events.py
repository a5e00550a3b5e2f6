"""KV-cache events: what the prefix cache and the disk tier hold, told at block granularity in
vLLM's event types, for routers outside the server (NVIDIA Dynamo's KV router, llm-d's KV-cache
manager, LMCache's controller). Pure Python; engine/kv_events.py publishes them over ZMQ.

A block is `block_size` consecutive tokens of one cached path, from position k*block_size.
It is stored while the cache holds all of its tokens (a tail shorter than a block is never
told); it is removed when any of them goes. Its hash chains, as vLLM's do:

    hash(block k) = int.from_bytes(blake2b(parent || ns_key || tokens, digest_size=8), "big")

where parent is the previous block's hash as 8 big-endian bytes (8 zero bytes for the first
block), ns_key the 16-byte `namespace_key` of the namespace the block's last token is cached
in (the shared public prefix has its own; the disk tier's blocks: the request's namespace),
followed, for a block that starts in the public prefix and ends past it, by the count of its
public tokens as 4 big-endian bytes, and tokens the block's token ids as unsigned 32-bit
little-endian. So two tenants' (or two cache salts') blocks never share a hash, nor two paths
that split the same tokens differently between the public prefix and a namespace, and a
subscriber can recompute every hash from the token ids and the `extra_keys` each event carries
(one per block: the namespace key in hex, then the public count where there is one).

A block cached for a LoRA adapter's requests (whose namespace folds in the adapter) carries the
adapter as vLLM's do: `lora_name` its served name and `lora_id` the number the server gave it
when it was loaded (1, 2, ... in load order: `/v1/load_lora_adapter` answers it as
`adapter.id`); the base model's: None.

Media: the KV pool is "GPU" on a GPU and "CPU" on a CPU; the disk tier is "DISK". Models with
sliding-window layers tell two groups, as vLLM's hybrid allocator does: group 0 (full attention:
the block is cached) and group 1 (sliding window: every token of the block still holds its
window KV, which `evict_window` drops and a later insert can give back).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from radixserve.cache.prefix import Namespace

FULL, WINDOW = 0, 1  # groups: full-attention KV, sliding-window KV
MAX_LORA_NAMESPACES = 65536  # the adapters' namespaces remembered (the oldest first forgotten)
KINDS = {FULL: "full_attention", WINDOW: "sliding_window"}
DISK = "DISK"


# -- the wire types: vLLM's (vllm/distributed/kv_events.py), array-like and tagged ------------------
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# -- the hash -----------------------------------------------------------------------------------
def namespace_key(ns: Namespace) -> bytes:
    """16 bytes naming a namespace (every field of it; the public prefix: both None)."""
    return hashlib.blake2b(json.dumps([ns.tenant, ns.cache_salt]).encode(), digest_size=16).digest()


def block_hash(parent: int | None, ns_key: bytes, tokens: Sequence[int], public: int = 0) -> int:
    """`public`: a block that starts in the shared public prefix and ends in a namespace's own
    tokens: how many of its tokens are public (0: all of it is in `ns_key`'s namespace)."""
    h = hashlib.blake2b((parent or 0).to_bytes(8, "big"), digest_size=8)
    h.update(ns_key)
    if public:
        h.update(public.to_bytes(4, "big"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


def extra_key(ns_key: bytes, public: int = 0) -> tuple[Any, ...]:
    """A block's `extra_keys` entry: its namespace key in hex, and its public tokens if any."""
    return (ns_key.hex(), public) if public else (ns_key.hex(),)


def chain(parent: int | None, ns_key: bytes, tokens: Sequence[int], block_size: int, public: int = 0) -> list[int]:
    """The hashes of the whole blocks of `tokens`, the first chained to `parent` (and holding
    `public` public tokens)."""
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, ns_key, tokens[i : i + block_size], public if i == 0 else 0)
        out.append(parent)
    return out


class BlockEvents:
    """The events not yet published, and the blocks told as stored (per medium and group), which
    `/server_info` counts and the cache's integrity check compares with the tree. Thread-safe:
    the engine thread (the tree) and the disk tier's threads record into it; the publisher takes."""

    def __init__(self, block_size: int, medium: str, window: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"kv_events_config: block_size must be a positive integer, got {block_size}")
        self.block_size = block_size
        self.medium = medium  # the KV pool's
        self.window = window  # sliding-window layers' window (0: none; group 1 is then never told)
        self._lock = threading.Lock()
        self._pending: list[KVCacheEvent] = []
        self._ready = threading.Event()
        self.live: dict[tuple[str, int], set[int]] = {}  # (medium, group) -> block hashes stored
        self._disk: dict[str, list[int]] = {}  # disk block key -> its blocks' hashes
        self._disk_refs: Counter[int] = Counter()  # block hash -> disk blocks holding it (they are coarser)
        self._lora: dict[str, tuple[int, str]] = {}  # a namespace key (hex) -> the LoRA adapter it caches for

    def tag_lora(self, ns: Namespace, lora_id: int, name: str) -> None:
        """The blocks cached in `ns` are the adapter's (the engine tells this as each such request comes)."""
        key = namespace_key(ns).hex()
        with self._lock:
            self._lora.pop(key, None)
            self._lora[key] = (lora_id, name)
            if len(self._lora) > MAX_LORA_NAMESPACES:
                del self._lora[next(iter(self._lora))]

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], extra: Sequence[tuple[Any, ...] | None],
               medium: str | None = None, group: int = FULL) -> None:
        if not hashes:
            return
        medium = medium or self.medium
        spec = self.window if group == WINDOW else None
        with self._lock:
            self.live.setdefault((medium, group), set()).update(hashes)
            last = extra[-1] if extra else None  # (the namespace of the blocks' last token: an adapter's own)
            lora_id, lora_name = self._lora.get(last[0], (None, None)) if last else (None, None)
            self._pending.append(BlockStored(hashes, parent, tokens, self.block_size, lora_id, medium, lora_name,
                                             list(extra), group, KINDS[group], spec))
        self._ready.set()

    def removed(self, hashes: list[int], medium: str | None = None, group: int = FULL) -> None:
        if not hashes:
            return
        with self._lock:
            self._removed(hashes, medium or self.medium, group)
        self._ready.set()

    def _removed(self, hashes: list[int], medium: str, group: int) -> None:
        self.live.get((medium, group), set()).difference_update(hashes)
        self._pending.append(BlockRemoved(hashes, medium, group))

    def cleared(self) -> None:
        """Everything is gone (pool and disk; the removals told one by one before): AllBlocksCleared."""
        with self._lock:
            self.live.clear()
            self._disk.clear()
            self._disk_refs.clear()
            self._pending.append(AllBlocksCleared())
        self._ready.set()

    # -- the disk tier (its writer and reader threads) ---------------------------------------
    def disk_stored(self, key: str, hashes: list[int], parent: int | None, tokens: list[int], ns_key: bytes) -> None:
        """A disk block written (or found): its blocks no other disk block holds are stored. Those
        another holds are a head of it (the same tokens from the start), so the rest is a chain."""
        with self._lock:
            if key in self._disk:
                return
            self._disk[key] = hashes
            held = 0
            while held < len(hashes) and self._disk_refs[hashes[held]]:
                held += 1
            self._disk_refs.update(hashes)
            if held == len(hashes):
                return
            b = self.block_size
            new, parent = hashes[held:], hashes[held - 1] if held else parent
            self.live.setdefault((DISK, FULL), set()).update(new)
            lora_id, lora_name = self._lora.get(ns_key.hex(), (None, None))
            self._pending.append(BlockStored(new, parent, tokens[held * b :], b, lora_id, DISK, lora_name,
                                             [extra_key(ns_key)] * len(new), FULL, KINDS[FULL]))
        self._ready.set()

    def disk_removed(self, key: str) -> None:
        with self._lock:
            gone = []
            for h in self._disk.pop(key, None) or []:
                self._disk_refs[h] -= 1
                if not self._disk_refs[h]:
                    del self._disk_refs[h]
                    gone.append(h)
            if gone:
                self._removed(gone, DISK, FULL)
        self._ready.set()

    # -- the publisher -----------------------------------------------------------------------
    def take(self, timeout: float) -> list[KVCacheEvent]:
        """The events recorded since the last take (waits up to `timeout` for one)."""
        self._ready.wait(timeout)
        with self._lock:
            self._ready.clear()
            out, self._pending = self._pending, []
        return out

    def count(self, medium: str | None = None, group: int = FULL) -> int:
        """Blocks told as stored in a medium (the pool's by default) and group."""
        with self._lock:
            return len(self.live.get((medium or self.medium, group), ()))

    def has_disk(self, key: str) -> bool:
        """Whether the disk block `key` is told as stored."""
        with self._lock:
            return key in self._disk


def batch(events: list[KVCacheEvent], rank: int | None) -> KVEventBatch:
    return KVEventBatch(time.time(), events, rank)  # type: ignore[arg-type]
