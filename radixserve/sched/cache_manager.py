"""The only glue between requests and KV memory (allocator + prefix cache).

Slots of one request, as held in the request-to-slots table:

    |<--------------------- table[rid] ---------------------->|
    |<- cached_len: owned by the ->|<- owned by the request ->|
    |   prefix cache, locked       |   (computed + allocated) |

At release the computed part is offered to the prefix cache; whatever it does not
adopt, and every allocated-but-not-computed slot, goes back to the allocator.
"""

from __future__ import annotations

from typing import Any

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.prefix import Namespace, PrefixCache
from radixserve.request import Req


class CacheManager:
    def __init__(self, allocator: SlotAllocator, prefix: PrefixCache) -> None:
        self.allocator = allocator
        self.prefix = prefix
        self._table: dict[str, list[int]] = {}
        self._locks: dict[str, Any] = {}

    # -- queries ----------------------------------------------------------------------
    def slots(self, req: Req) -> list[int]:
        return self._table[req.rid]

    def num_slots(self, req: Req) -> int:
        table = self._table.get(req.rid)
        return len(table) if table is not None else 0

    def available(self) -> int:
        """Slots that could be had now: free plus evictable."""
        return self.allocator.num_free + self.prefix.evictable_tokens

    @staticmethod
    def namespace(req: Req) -> Namespace:
        return getattr(req, "namespace", None)

    # -- lifecycle ----------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Match and lock the cached prefix; the request then feeds only the rest."""
        limit = len(req.token_ids) - 1  # at least one token must be fed to get logits
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.params.logprob_start_len - 1, 0))
        m = self.prefix.match(self.namespace(req), req.token_ids[: max(limit, 0)])
        self.prefix.lock(m.handle)
        self._locks[req.rid] = m.handle
        self._table[req.rid] = list(m.slots)
        req.cached_len = req.computed_len = m.length
        if req.retractions == 0:
            req.cached_tokens = m.length  # what the caller is told; re-admissions don't count

    def alloc(self, req: Req, n: int) -> bool:
        """Append n fresh slots to the request's table, evicting cached leaves if needed."""
        slots = self.allocator.alloc(n)
        if slots is None:
            short = n - self.allocator.num_free
            freed = self.prefix.evict(short)
            if freed:
                self.allocator.free(freed)
            slots = self.allocator.alloc(n)
            if slots is None:
                return False
        self._table[req.rid].extend(slots)
        return True

    def release(self, req: Req) -> None:
        """Give back everything the request holds. Safe to call for a never-admitted request."""
        table = self._table.pop(req.rid, None)
        if table is None:
            return
        done = min(req.computed_len, len(table))
        dup = self.prefix.insert(self.namespace(req), req.token_ids[:done], table[:done])
        own = table[req.cached_len : max(dup, req.cached_len)] + table[done:]
        if own:
            self.allocator.free(own)
        self.prefix.unlock(self._locks.pop(req.rid))
        req.computed_len = 0

    def in_use(self) -> int:
        return self.allocator.num_used - self.prefix.cached_tokens
