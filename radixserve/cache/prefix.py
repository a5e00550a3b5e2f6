"""The prefix-cache contract the cache manager talks to, and the null cache that shares nothing.

Units: token ids in, slot indices out. Lengths are whole pages: a cache with page size N
matches, inserts and evicts multiples of N tokens, and callers pass page-aligned lengths to
`insert`. Ownership: slots handed to `insert` beyond the returned count belong to the cache
from then on; the caller frees the rest. Locked prefixes are never evicted; whoever locks
unlocks (the cache manager, once per admission or per adopted chunk).

Namespaces are structured keys, never joined strings: `Namespace(tenant, cache_salt)`, where
cache_salt is a fixed-size digest (`salt_key`) of the client's salt and the tenant's credential,
never either of them. Different namespaces never share a node. `public_len` marks the first tokens of a sequence
as living in the one shared PUBLIC namespace (an opt-in public prefix); the rest stays in
the caller's namespace.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

DEFAULT_TENANT = "default"


class Namespace(NamedTuple):
    tenant: str | None  # None only for PUBLIC; a request without a tenant uses DEFAULT_TENANT
    cache_salt: str | None = None  # salt_key(): the client's cache_salt and the tenant's credential, digested


PUBLIC = Namespace(None, None)


def salt_key(cache_salt: str | None, tenant_key: str | None = None) -> str | None:
    """A namespace's key under its tenant id: a digest of the pair (tenant_key, cache_salt), 32
    hex characters whatever the salt's length, or None when neither is given. `tenant_key` is a
    digest of the tenant's credential (server.auth): a tenant id issued again with another key
    finds none of the earlier owner's KV, in the pool or on disk. The pair is digested as JSON,
    so no two pairs share a key (no joined strings)."""
    if cache_salt is None and tenant_key is None:
        return None
    return hashlib.sha256(json.dumps([tenant_key, cache_salt]).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # tokens matched
    slots: list[int]  # their KV slots, len == length
    handle: Any = None  # what to pass to lock/unlock


class PrefixCache(ABC):
    page_size: int = 1
    shares: bool = True  # False: never holds anything (the cache manager skips mid-request inserts)
    reach: int = 0  # sliding-window layers: positions before its own a query sees (0: no such layers)

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    @abstractmethod
    def match(self, ns: Namespace, tokens: list[int], public_len: int = 0, whole: bool = False) -> PrefixMatch:
        """Longest cached prefix of `tokens` (page-aligned) in namespace `ns`, the first
        `public_len` tokens looked up in PUBLIC. Marks the matched path as recently used. With
        sliding-window layers, only as far as a query can start from (the window before the
        end holds its window KV), unless `whole` (the caller holds that window KV itself)."""

    @abstractmethod
    def insert(self, ns: Namespace, tokens: list[int], slots: list[int], public_len: int = 0, priority: int = 0,
               window_from: int = 0, on_revive: Callable[[list[int], list[int]], None] | None = None,
               retain: tuple[int, float] = (0, 0.0)) -> int:
        """Offer `tokens` (a whole number of pages) with their KV `slots`. Returns n: the first
        n slots duplicate what the cache already holds and stay the caller's to free; the
        cache owns slots[n:] from now on. `priority` feeds the priority eviction policy.
        Sliding-window layers: the caller holds window KV for tokens from `window_from` on only
        (RadixCache says how the rest and `on_revive` are used). `retain` = (k, until): the
        first k tokens are retained until `until` (epoch seconds): evicted after the rest."""

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Pin the path from the root to `handle` (a match's handle) against eviction."""

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Free at least n unlocked cached slots if possible; returns them for the allocator."""

    def lock_window(self, handle: Any) -> None:  # noqa: B027 (no window here: nothing to pin)
        """Pin the window KV that a query right after `handle` sees (sliding-window layers)."""

    def unlock_window(self, handle: Any) -> None:  # noqa: B027
        """Let go of `lock_window`'s pin."""

    def evict_window(self, n: int) -> list[int]:
        """Drop the window KV of at least n cached tokens no window lock covers, if possible
        (their full-attention KV stays cached); returns their slots."""
        return []

    def slots_with_window(self) -> list[int]:
        """Slots of the cached tokens that hold their window KV (integrity checks)."""
        return []

    @property
    def window_tokens(self) -> int:
        """Cached tokens that still hold their window KV."""
        return 0

    @property
    def window_evictable_tokens(self) -> int:
        return 0

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop everything (refused while anything is locked); returns the slots to free."""

    @abstractmethod
    def check_integrity(self) -> list[int]:
        """Verify the internal invariants (raises RuntimeError); returns every slot held."""

    @property
    @abstractmethod
    def cached_tokens(self) -> int: ...

    @property
    @abstractmethod
    def evictable_tokens(self) -> int: ...

    def branches(self, ns: Namespace, tokens: list[int], public_len: int, context: int, limit: int) -> list[list[int]]:
        """What other requests of namespace `ns` went on to write where they share a prefix with
        `tokens` (speculative drafting, sched/spec.py): token runs, each the `context` tokens of
        `tokens` before a branch point and then one cached path below it, most recently used
        first, `limit` tokens in all. Read-only: touches no LRU time. Never another namespace's
        tokens (PUBLIC ones neither). The null cache has none."""
        return []

    @property
    def version(self) -> int:
        """Changes whenever the cached token sequences do (what `branches` returns may differ)."""
        return 0

    @property
    def locked_tokens(self) -> int:
        return self.cached_tokens - self.evictable_tokens

    @property
    def evicted_tokens(self) -> int:
        return 0

    @property
    def namespaces(self) -> int:
        """Distinct namespaces with at least one cached node."""
        return 0


class NullPrefixCache(PrefixCache):
    """Shares nothing: every match is empty and every insert is refused."""

    shares = False

    def __init__(self, page_size: int = 1, window: int = 0) -> None:
        self.page_size = page_size
        self.reach = max(window - 1, 0)

    def match(self, ns: Namespace, tokens: list[int], public_len: int = 0, whole: bool = False) -> PrefixMatch:
        return PrefixMatch(0, [])

    def insert(self, ns: Namespace, tokens: list[int], slots: list[int], public_len: int = 0, priority: int = 0,
               window_from: int = 0, on_revive: Callable[[list[int], list[int]], None] | None = None,
               retain: tuple[int, float] = (0, 0.0)) -> int:
        return len(slots)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, n: int) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    def check_integrity(self) -> list[int]:
        return []

    @property
    def cached_tokens(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slice comparisons run at C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, step = 0, 64
    while lo + step <= n and a[lo : lo + step] == b[lo : lo + step]:
        lo += step
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo
