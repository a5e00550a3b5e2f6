"""The prefix-cache contract the cache manager talks to, and the null cache that shares nothing.

Units: token ids in, slot indices out. Ownership: slots handed to `insert` beyond the
returned count belong to the cache from then on; the caller frees the rest. Locked
prefixes are never evicted; whoever locks unlocks (the cache manager, once per admission).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

Namespace = Hashable  # a structured key such as (tenant, cache_salt); never a joined string


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # tokens matched
    slots: list[int]  # their KV slots, len == length
    handle: Any = None  # what to pass to lock/unlock


class PrefixCache(ABC):
    @abstractmethod
    def match(self, ns: Namespace, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in namespace `ns`."""

    @abstractmethod
    def insert(self, ns: Namespace, tokens: list[int], slots: list[int]) -> int:
        """Offer `tokens` with their KV `slots`. Returns n: the first n slots duplicate what
        the cache already holds (or were refused) and stay the caller's to free; the cache
        owns slots[n:] from now on."""

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Free at least n unlocked cached slots if possible; returns them for the allocator."""

    @property
    @abstractmethod
    def cached_tokens(self) -> int: ...

    @property
    @abstractmethod
    def evictable_tokens(self) -> int: ...


class NullPrefixCache(PrefixCache):
    """Shares nothing: every match is empty and every insert is refused."""

    def match(self, ns: Namespace, tokens: list[int]) -> PrefixMatch:
        return PrefixMatch(0, [])

    def insert(self, ns: Namespace, tokens: list[int], slots: list[int]) -> int:
        return len(slots)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def evict(self, n: int) -> list[int]:
        return []

    @property
    def cached_tokens(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0
