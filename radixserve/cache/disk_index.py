"""The disk tier's index: which blocks the store holds, by recency, and its totals. Pure
bookkeeping (cache/disk.DiskStore does the files), O(1) per operation (the expiry heap's
rebuild amortized): no write scans every block.

Recency lists (least recently used first), retained blocks apart from the rest:

    (None, False)  every block not retained now     evicted first, the oldest first
    (None, True)   every block retained now          at most `held_max` bytes of them
    (tag,  False)  one tenant's, not retained        the tenant's quota takes these first,
    (tag,  True)   one tenant's, retained            then these

NOTE: a block retained now is in the two held lists and in `_expiry`; a block that loses its
retention (it lapsed, or the retained share overflowed and it was the oldest retained) moves to
the front of the plain lists: the next to go.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Entry:
    path: Path
    size: int  # bytes on disk
    tag: str  # its tenant's tag
    tokens: int
    until: float  # retained until (epoch seconds; 0: never retained)
    held: bool = False  # in the held lists (retained, as of the last expire)


class BlockIndex:
    def __init__(self, held_max: int) -> None:
        self.held_max = held_max  # bytes that retained blocks may hold at most
        self.entries: dict[str, Entry] = {}
        self.bytes = 0
        self.held_bytes = 0
        self.tenant_tokens: dict[str, int] = {}
        self._lists: dict[tuple[str | None, bool], OrderedDict[str, None]] = {}
        self._expiry: list[tuple[float, str]] = []  # (until, key) of held blocks; stale pairs are skipped

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    # -- membership -------------------------------------------------------------------------
    def add(self, key: str, e: Entry) -> None:
        """A new block (not in the index), the most recently used, not held yet (see `hold`)."""
        e.held = False
        self.entries[key] = e
        self.bytes += e.size
        self.tenant_tokens[e.tag] = self.tenant_tokens.get(e.tag, 0) + e.tokens
        self._link(key, e)

    def remove(self, key: str) -> Entry | None:
        e = self.entries.pop(key, None)
        if e is None:
            return None
        self._unlink(key, e)
        self.bytes -= e.size
        self.tenant_tokens[e.tag] -= e.tokens
        if not self.tenant_tokens[e.tag]:
            del self.tenant_tokens[e.tag]
        if e.held:
            self.held_bytes -= e.size
        return e

    def touch(self, key: str) -> None:
        e = self.entries[key]
        for scope in (None, e.tag):
            self._lists[(scope, e.held)].move_to_end(key)

    def oldest(self, tag: str | None = None) -> str | None:
        """The next block to evict (of one tenant's, or of all): the least recently used one not
        retained, else the least recently used retained one."""
        for held in (False, True):
            found = self._lists.get((tag, held))
            if found:
                return next(iter(found))
        return None

    # -- retention --------------------------------------------------------------------------
    def hold(self, key: str) -> list[str]:
        """The block's `until` is set (in the future): it is held. If retained blocks then hold more
        than `held_max` bytes, the oldest retained ones lose their retention (`until` 0): their
        keys are returned (the store renames their files)."""
        e = self.entries[key]
        if not e.held:
            self._unlink(key, e)
            e.held = True
            self.held_bytes += e.size
            self._link(key, e)
        heapq.heappush(self._expiry, (e.until, key))
        if len(self._expiry) > 2 * len(self._lists[(None, True)]) + 64:  # stale pairs (retentions extended)
            self._rebuild_expiry()
        demoted = []
        while self.held_bytes > self.held_max:
            old = next(iter(self._lists[(None, True)]))
            self._release(old)
            self.entries[old].until = 0.0
            demoted.append(old)
        return demoted

    def expire(self, now: float) -> None:
        """Blocks whose retention has passed are held no more."""
        while self._expiry and self._expiry[0][0] <= now:
            until, key = heapq.heappop(self._expiry)
            e = self.entries.get(key)
            if e is not None and e.held and e.until == until:
                self._release(key)

    def _release(self, key: str) -> None:
        e = self.entries[key]
        self._unlink(key, e)
        e.held = False
        self.held_bytes -= e.size
        self._link(key, e, first=True)

    def _rebuild_expiry(self) -> None:
        self._expiry = [(self.entries[k].until, k) for k in self._lists.get((None, True), ())]
        heapq.heapify(self._expiry)

    # -- the lists --------------------------------------------------------------------------
    def _link(self, key: str, e: Entry, first: bool = False) -> None:
        for scope in (None, e.tag):
            found = self._lists.setdefault((scope, e.held), OrderedDict())
            found[key] = None
            if first:
                found.move_to_end(key, last=False)

    def _unlink(self, key: str, e: Entry) -> None:
        for scope in (None, e.tag):
            found = self._lists[(scope, e.held)]
            del found[key]
            if not found and scope is not None:
                del self._lists[(scope, e.held)]
