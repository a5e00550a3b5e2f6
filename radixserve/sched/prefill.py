"""PrefillAdder: admits prefill chunks under a per-iteration token budget and a memory
reservation for what running requests will still need. The last request admitted is the
one that gets chunked; the next iteration continues it before admitting anyone new.

With sliding-window layers in a pool of their own, admission also keeps to that pool: a
request holds at most its window and a chunk of it at a time (what lies further back drops
its window KV as the request moves on).

While tenants share the engine the budget is in token-equivalents (`context_cost` set): a chunk
of n tokens after s cached or computed ones costs n * (1 + (s + n) / context_cost), its
attention over the context counted beside its linear layers, so that a step stays as short
against an 8k context as against an empty one (ArchConfig.context_cost)."""

from __future__ import annotations

import math

from radixserve.config import SchedConfig
from radixserve.request import Req
from radixserve.sched.cache_manager import CacheManager


class PrefillAdder:
    def __init__(self, cfg: SchedConfig, cache: CacheManager, running: list[Req], ratio: float) -> None:
        self.cfg = cfg
        self.cache = cache
        self.ratio = ratio
        self.budget = cfg.chunked_prefill_size
        self.headroom = cache.available() - sum(self.reservation(r) for r in running)
        self.slots_left = cfg.max_running_requests - len(running)
        self.idle = not running
        self.windowed = cache.windowed is not None
        self.context_cost = 0.0  # 0: the budget is in tokens; else in token-equivalents (cost)
        step = cfg.chunked_prefill_size + 2 * cache.page_size  # a chunk, page-rounded at both ends
        self.window_span = cache.reach + step  # the most of the window pool one request holds
        if self.windowed:
            self.window_room = cache.window_available() - sum(min(self.reservation(r), step) for r in running)

    @property
    def can_admit(self) -> bool:
        return self.budget > 0 and self.slots_left > 0

    def reservation(self, req: Req) -> int:
        """Slots a request may still claim: its unallocated extend plus a share of its decodes."""
        unallocated = len(req.token_ids) - self.cache.num_slots(req)
        return max(unallocated, 0) + self._decode_share(req)

    def _decode_share(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens, self.cfg.reserve_clip_tokens) * self.ratio)

    def cost(self, req: Req, n: int) -> int:
        """What req's next n tokens take from the budget."""
        if not self.context_cost:
            return n
        return math.ceil(n * (1 + (req.computed_len + n) / self.context_cost))

    def fit(self, req: Req, budget: int) -> int:
        """The most of req's next tokens that cost at most `budget` (at least one while budget is
        left: a chunk against a context too long for the whole budget still moves)."""
        if budget <= 0:
            return 0
        if not self.context_cost:
            return min(req.extend_len, budget)
        e, lead = self.context_cost, 1 + req.computed_len / self.context_cost  # n * (lead + n / e) <= budget
        n = min(req.extend_len, int((math.sqrt(lead * lead + 4 * budget / e) - lead) * e / 2) + 1)
        while n > 1 and self.cost(req, n) > budget:
            n -= 1
        return max(n, 1)

    def continue_chunk(self, req: Req, limit: int | None = None) -> int:
        """Next chunk of an admitted, partly prefilled request (memory was reserved at admission),
        costing at most `limit`."""
        n = self.fit(req, min(self.budget, self.budget if limit is None else limit))
        if n <= 0 or not self.cache.alloc(req, n):
            return 0
        self.budget -= self.cost(req, n)
        return n

    def admit(self, req: Req) -> int:
        """Admit a waiting request and allocate its first chunk; 0 means stop admitting."""
        if not self.can_admit:
            return 0
        before, before_window = self.cache.available(), self.cache.window_available()
        self.cache.admit(req)
        pinned = before - self.cache.available()  # cached tokens this admission locked: no longer evictable
        need = req.extend_len + self._decode_share(req) + pinned
        n = self.fit(req, self.budget)
        # With nothing running, admit whatever fits at all: waiting for memory would deadlock.
        fits = need <= self.headroom or (self.idle and req.extend_len <= self.cache.available())
        if self.windowed:
            window_need = min(need - pinned, self.window_span) + before_window - self.cache.window_available()
            fits = fits and (window_need <= self.window_room or self.idle)
        if not fits or not self.cache.alloc(req, n):
            self.cache.release(req)
            return 0
        if self.windowed:
            self.window_room -= window_need
        self.budget -= self.cost(req, n)
        self.headroom -= need
        self.slots_left -= 1
        self.idle = False
        return n
