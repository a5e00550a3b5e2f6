"""The only glue between requests and KV memory (allocator + prefix cache).

Slots of one request, as held in its table entry:

    |<------------------------- entry.slots -------------------------->|
    |<- cached_len: owned by the prefix ->|<- owned by the request ---->|
    |   cache, locked (entry.handle)      |   (computed + allocated)    |

After each prefill chunk the computed whole pages are offered to the prefix cache: the
request then holds the cache's slots for them (its own duplicates are freed) and locks the
longer path. At release the computed part is offered once more; whatever the cache does not
adopt, and every allocated-but-not-computed slot, goes back to the allocator. With pages,
the request's slots after cached_len fill its pages in order, so len(slots) % page_size
tells how much of its last page is still unused.

Sliding-window layers (a WindowedAllocator): each page also holds a window page until no
query can see it. The request's own pages below `window_from` have dropped theirs (`slide`,
after every step: a query at position p sees p - reach .. p); its cached prefix's window is
pinned with the prefix cache's window lock until the request is `reach` positions past it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.cache.allocator import SlotAllocator, WindowedAllocator, WindowTables
from radixserve.cache.prefix import DEFAULT_TENANT, Namespace, PrefixCache
from radixserve.request import Req


@dataclass
class _Entry:
    slots: list[int]
    handle: Any  # the locked prefix-cache path
    cached: int  # == req.cached_len
    window_from: int = 0  # own pages (from `cached` on) before this position have dropped their window KV
    window_locked: bool = False  # holds the prefix cache's window lock on handle


class CacheManager:
    def __init__(self, allocator: SlotAllocator, prefix: PrefixCache) -> None:
        if allocator.page_size != prefix.page_size:
            raise ValueError(f"page_size: allocator {allocator.page_size} != prefix cache {prefix.page_size}")
        self.allocator = allocator
        self.prefix = prefix
        self.page_size = allocator.page_size
        self._table: dict[str, _Entry] = {}
        self._holds: dict[str, Any] = {}  # rid -> a prefix a lower tier put back for it, locked until it is admitted
        self.windowed: WindowedAllocator | None = allocator if isinstance(allocator, WindowedAllocator) else None
        self.reach = prefix.reach if self.windowed is not None else 0
        if self.windowed is not None and not self.reach:
            raise ValueError("a window pool needs a prefix cache built with the model's window")
        self.window_tables = WindowTables(self.windowed.window_slots, self.reach) if self.windowed is not None else None

    # -- queries ----------------------------------------------------------------------------
    def slots(self, req: Req) -> list[int]:
        return self._table[req.rid].slots

    def num_slots(self, req: Req) -> int:
        entry = self._table.get(req.rid)
        return len(entry.slots) if entry is not None else 0

    def available(self) -> int:
        """Slots that could be had now: free plus evictable."""
        return self.allocator.num_free + self.prefix.evictable_tokens

    def in_use(self) -> int:
        """Slots held by requests (not by the prefix cache)."""
        return self.allocator.num_used - self.prefix.cached_tokens

    def window_available(self) -> int:
        """Window-pool slots that could be had now (free, or droppable from cached tokens)."""
        if self.windowed is None:
            return 0
        return self.windowed.window.num_free + self.prefix.window_evictable_tokens

    @staticmethod
    def namespace(req: Req) -> Namespace:
        return Namespace(req.tenant or DEFAULT_TENANT, req.cache_salt)

    def match_limit(self, req: Req) -> int:
        """How much of the request's tokens may come from the cache (at least one must be fed,
        and prompt logprobs need their positions computed)."""
        limit = len(req.token_ids) - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.params.logprob_start_len - 1, 0))
        return max(limit, 0)

    def match_len(self, req: Req) -> int:
        """Cached prefix length the request would get if admitted now (nothing is locked)."""
        return self.prefix.match(self.namespace(req), req.token_ids[: self.match_limit(req)], req.public_prefix_len).length

    def branches(self, req: Req, context: int, limit: int) -> list[list[int]]:
        """What other requests of its namespace wrote where they share a prefix with it
        (`PrefixCache.branches`: speculative drafts; never another namespace's tokens)."""
        return self.prefix.branches(self.namespace(req), req.token_ids, req.public_prefix_len, context, limit)

    # -- lifecycle --------------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Match and lock the cached prefix; the request then feeds only the rest."""
        m = self.prefix.match(self.namespace(req), req.token_ids[: self.match_limit(req)], req.public_prefix_len)
        self.prefix.lock(m.handle)
        self.prefix.lock_window(m.handle)
        self._table[req.rid] = _Entry(list(m.slots), m.handle, m.length, m.length, True)
        req.cached_len = req.computed_len = m.length

    def adopt(self, req: Req, upto: int, fill: Callable[[int, list[int]], None], have_from: int = 0) -> int:
        """Put the request's first `upto` tokens (whole pages), whose KV a lower tier holds, into
        the prefix cache while it waits: slots for what the cache lacks (evicting if need be),
        `fill(start, slots)` writes the KV of tokens [start, upto) there, and the prefix stays
        locked for the request until it is admitted (`admitted`) or finished. The caller holds the KV of
        tokens [have_from, upto) only: if the cache has since lost some before have_from, nothing
        is put back. Returns the tokens put back (0: none; the request then computes them)."""
        ns, tokens = self.namespace(req), req.token_ids[:upto]
        m = self.prefix.match(ns, tokens, req.public_prefix_len, whole=True)
        if m.length < have_from:
            return 0
        got: list[int] | None = None
        if m.length < upto:
            self.prefix.lock(m.handle)  # the head it continues must not be evicted to make room
            got = self.allocator.alloc(upto - m.length)
            if got is None:
                freed = self.prefix.evict(upto - m.length - self.allocator.num_free)
                if freed:
                    self.allocator.free(freed)
                got = self.allocator.alloc(upto - m.length)
            self.prefix.unlock(m.handle)
            if got is None:
                return 0
            try:
                fill(m.length, got)
            except BaseException:
                self.allocator.free(got)
                raise
            dup = self.prefix.insert(ns, tokens, [*m.slots, *got], req.public_prefix_len, req.priority,
                                     retain=(req.retained_tokens, req.retain_until))
            if dup > m.length:
                self.allocator.free(got[: dup - m.length])
        held = self.prefix.match(ns, tokens, req.public_prefix_len, whole=True)
        self.prefix.lock(held.handle)
        self._let_go(req.rid)
        self._holds[req.rid] = held.handle
        return len(got or ())

    def let_go_all(self) -> bool:
        """Unlock every prefix `adopt` holds for a waiting request (they stay cached, evictable);
        False if none was held."""
        held = bool(self._holds)
        for rid in list(self._holds):
            self._let_go(rid)
        return held

    def admitted(self, req: Req) -> None:
        """The request is running, its own lock on its prefix taken: what `adopt` held for it goes."""
        self._let_go(req.rid)

    def _let_go(self, rid: str) -> None:
        handle = self._holds.pop(rid, None)
        if handle is not None:
            self.prefix.unlock(handle)

    def alloc(self, req: Req, n: int, evict: bool = True) -> bool:
        """Append n slots to the request's table (the rest of its last page first), evicting
        unlocked cached leaves when free pages run short (unless `evict` is False)."""
        slots = self._table[req.rid].slots
        spare = min((-len(slots)) % self.page_size, n)
        fresh: list[int] = []
        if n > spare:
            got = self.allocator.alloc(n - spare)
            if got is None and not evict:
                return False
            if got is None:
                full, _ = self.allocator.short(n - spare)
                freed = self.prefix.evict(full) if full else []
                if freed:
                    self.allocator.free(freed)
                _, window = self.allocator.short(n - spare)  # what is still missing after that eviction
                if window and self.windowed is not None:
                    self.windowed.drop_window(self.prefix.evict_window(window))
                got = self.allocator.alloc(n - spare)
                if got is None:
                    return False
            fresh = got[: n - spare]
        if spare:
            slots.extend(range(slots[-1] + 1, slots[-1] + 1 + spare))
        slots.extend(fresh)
        return True

    def trim(self, req: Req) -> None:
        """Give back the slots past computed_len (the rejected part of a draft): pages the
        request no longer touches go back to the allocator; the rest of its last page stays
        its spare room, as `alloc` expects."""
        entry = self._table.get(req.rid)
        if entry is None or len(entry.slots) <= req.computed_len:
            return
        keep = max(req.computed_len, entry.cached)
        cut = entry.slots[keep:]
        del entry.slots[keep:]
        ps = self.page_size
        if ps > 1 and entry.slots:  # the kept part's last page stays (free() frees whole pages)
            last = entry.slots[-1] // ps
            cut = [s for s in cut if s // ps != last]
        if cut:
            self.allocator.free(cut)

    def cache_prefix(self, req: Req) -> None:
        """After a prefill chunk: hand the computed whole pages to the prefix cache, so other
        requests (siblings waiting for this prompt) can hit them before this one finishes."""
        entry = self._table.get(req.rid)
        done = self.prefix.aligned(req.computed_len)
        if not self.prefix.shares or entry is None or done <= entry.cached:
            return
        ns = self.namespace(req)
        tokens = req.token_ids[:done]
        dup = self._insert(req, entry, done)
        if dup > entry.cached:
            self.allocator.free(entry.slots[entry.cached : dup])  # ours duplicated someone else's
        m = self.prefix.match(ns, tokens, req.public_prefix_len, whole=True)
        if m.length != done:
            raise RuntimeError(f"prefix cache lost {req.rid}'s tokens: matched {m.length} of {done} just inserted")
        entry.slots[:done] = m.slots
        self.prefix.lock(m.handle)
        self.prefix.lock_window(m.handle)
        self._unlock(entry)
        entry.handle, entry.cached, entry.window_locked = m.handle, done, True
        req.cached_len = done

    def _insert(self, req: Req, entry: _Entry, done: int) -> int:
        """Offer the request's first `done` tokens to the prefix cache (see PrefixCache.insert)."""
        revive = self.windowed.move_window if self.windowed is not None else None
        return self.prefix.insert(self.namespace(req), req.token_ids[:done], entry.slots[:done], req.public_prefix_len,
                                  req.priority, max(entry.window_from, entry.cached), revive, (req.retained_tokens, req.retain_until))

    def _unlock(self, entry: _Entry) -> None:
        if entry.window_locked:
            self.prefix.unlock_window(entry.handle)
            entry.window_locked = False
        self.prefix.unlock(entry.handle)

    def slide(self, req: Req) -> None:
        """After a step, with sliding-window layers: drop the window KV of the request's own pages
        that no query of its can see any more (all before computed_len - reach), and its window
        lock on the cached prefix once it is that far past it."""
        entry = self._table.get(req.rid)
        if self.windowed is None or entry is None:
            return
        seen_from = req.computed_len - self.reach  # the next query (at computed_len) sees from here on
        if entry.window_locked and seen_from >= entry.cached:
            self.prefix.unlock_window(entry.handle)
            entry.window_locked = False
        dead = self.prefix.aligned(min(seen_from, len(entry.slots)))
        lo = max(entry.window_from, entry.cached)
        if dead > lo:
            self.windowed.drop_window(entry.slots[lo:dead])
            entry.window_from = dead

    def release(self, req: Req) -> None:
        """Give back everything the request holds. Safe to call for a never-admitted request (a
        waiting one keeps what `adopt` put back for it unless it has finished)."""
        if req.finish_reason is not None:
            self._let_go(req.rid)
        entry = self._table.pop(req.rid, None)
        if entry is None:
            return
        slots, cached = entry.slots, entry.cached
        done = max(self.prefix.aligned(min(req.computed_len, len(slots))), cached)
        dup = self._insert(req, entry, done)
        own = slots[cached : max(dup, cached)] + slots[done:]
        if own:
            self.allocator.free(own)
        self._unlock(entry)
        req.computed_len = req.cached_len = 0

    def flush(self) -> int:
        """Empty the prefix cache; refused while any request holds KV. Returns tokens dropped."""
        if self._table or self._holds:
            raise RuntimeError(f"flush_cache: refused while {len(self._table) + len(self._holds)} requests hold KV memory; "
                               "retry when idle")
        slots = self.prefix.reset()
        if slots:
            self.allocator.free(slots)
        return len(slots)

    def check_integrity(self) -> None:
        """Every page is exactly one of: free, held by the prefix cache, owned by one request;
        each request's cached part is what the cache holds for its tokens."""
        ps = self.page_size
        owner: dict[int, str] = {}

        def claim(pages: set[int], who: str) -> None:
            for p in pages:
                if p in owner:
                    raise RuntimeError(f"KV integrity: page {p} is owned by both {owner[p]} and {who}")
                owner[p] = who

        claim(self.allocator.free_pages(), "the free list")
        claim({s // ps for s in self.prefix.check_integrity()}, "the prefix cache")
        for rid, entry in self._table.items():
            claim({s // ps for s in entry.slots[entry.cached :]}, rid)
        total = self.allocator.size // ps
        if len(owner) != total:
            raise RuntimeError(f"KV integrity: {total - len(owner)} of {total} pages are owned by nobody (leaked)")
        if self.windowed is not None:
            self._check_windows()

    def _check_windows(self) -> None:
        """Each window page is free or held by exactly one page in use that should have one: a
        cached node that still holds its window KV, or a request's own page from window_from on."""
        w, ps = self.windowed, self.page_size
        assert w is not None
        should = {s // ps for s in self.prefix.slots_with_window()}
        for entry in self._table.values():
            should |= {s // ps for s in entry.slots[max(entry.window_from, entry.cached) :]}
        held = w.window_pages()
        if set(held) != should:
            raise RuntimeError(f"KV integrity: pages {sorted(set(held) ^ should)[:8]} hold a window page they should not, "
                               "or lack one they need")
        taken = list(held.values())
        if len(set(taken)) != len(taken) or set(taken) & w.window.free_pages():
            raise RuntimeError("KV integrity: a window page is held twice, or held and free")
        if len(taken) + len(w.window.free_pages()) != w.window.size // ps:
            raise RuntimeError("KV integrity: window pages are owned by nobody (leaked)")
