"""An approximate, per-replica index of the prompt prefixes a router has sent where.

Pure Python (no torch, no engine): the data-parallel engine and the Ray Serve request router
use the same one. A prefix is cut into blocks (`block` tokens, or characters where the router
only sees text) and each block is named by a chained hash seeded with its namespace:

    h0 = hash(namespace)          the tenant and cache_salt: another namespace never matches
    h1 = hash(h0, block 1)        a block's hash names the whole prefix up to its end
    h2 = hash(h1, block 2) ...

so "replica r holds prefix p up to block i" is one set lookup, as in llm-d's and the Gateway
API Inference Extension's prefix scorers. Each replica keeps at most `capacity` blocks,
least recently routed first out; a prefix's deepest blocks are marked older than its first
ones, so eviction cuts a chain from its end, as a radix cache evicts leaves.

NOTE: approximate by design. The index records what was routed, not what the engine still
holds: the engine may have evicted a block the index remembers (the request is then routed
for a hit that is a recompute), and a replica that restarts cold must be `forget`-ten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

Replica = Any  # any hashable id: a replica's index (DataParallelEngine), a Ray replica's id string


def block_hashes(namespace: Hashable, prefix: Sequence[int] | str, block: int, max_blocks: int) -> list[int]:
    """The chained hash of each whole block of `prefix` (at most max_blocks of them)."""
    out: list[int] = []
    h = hash(("radixserve-ns", namespace))
    n = min(len(prefix) // block, max_blocks)
    for i in range(n):
        part = prefix[i * block:(i + 1) * block]
        h = hash((h, part if isinstance(part, str) else tuple(part)))
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: dict[int, set[Replica]] = {}  # block hash -> replicas it was routed to
        self._lru: dict[Replica, OrderedDict[int, None]] = {}  # per replica, oldest first

    def match(self, hashes: Sequence[int], replicas: Iterable[Replica]) -> dict[Replica, int]:
        """Replica -> how many leading blocks of `hashes` were routed to it (0 for the others)."""
        depth = dict.fromkeys(replicas, 0)
        alive = set(depth)
        for i, h in enumerate(hashes):
            alive &= self._owners.get(h, set())
            if not alive:
                break
            for r in alive:
                depth[r] = i + 1
        return depth

    def insert(self, replica: Replica, hashes: Sequence[int]) -> None:
        """Record that `replica` was sent this prefix (and now holds it, approximately)."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # the first block ends up the most recent: evicted last
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._owners.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity:
            self._drop(replica, lru.popitem(last=False)[0])

    def forget(self, replica: Replica) -> None:
        """The replica restarted cold or left: nothing is cached there any more."""
        for h in self._lru.pop(replica, ()):
            self._drop(replica, h)

    def size(self, replica: Replica) -> int:
        """Blocks recorded for the replica."""
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def _drop(self, replica: Replica, h: int) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[h]
