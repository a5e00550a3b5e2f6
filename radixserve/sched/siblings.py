"""Sibling deduplication: when waiting requests share a prompt prefix that is not cached yet
but that a request admitted before them is prefilling right now, hold them back until it is
computed (the cache manager inserts it after each chunk) and let them hit it instead of
computing it again. 16 branches sent at the same instant then compute the shared prompt once.

A held request waits only while its leader is still prefilling the shared part; a leader that
finishes its prompt, or is retracted, stops holding anyone. A request is first held only for a
gain of at least MIN_GAIN tokens (SGLang's in-batch prefix threshold is the same 32): a step
against another tenant's long prompt can take a tenth of a second, so waiting one to save a
few tokens' prefill would delay its first token by that step. Once held it waits for the
whole shared part (the branches of a fork then share every whole page of it).
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache.prefix import common_prefix_len
from radixserve.request import Req
from radixserve.sched.cache_manager import CacheManager

MIN_GAIN = 32  # tokens a held request must gain over what the cache already gives it


class SiblingGate:
    def __init__(self, cache: CacheManager, running: list[Req], cached_len: Callable[[Req], int] | None = None) -> None:
        self.cache = cache
        self.cached_len = cached_len or cache.match_len
        shares = cache.prefix.shares  # without a prefix cache nobody can hit anything: hold no one
        self.leaders = [r for r in running if r.computed_len < r.prompt_len] if shares else []

    def add_leader(self, req: Req) -> None:
        if self.cache.prefix.shares:
            self.leaders.append(req)

    def holds(self, req: Req) -> bool:
        """True when a leader is computing a prefix this request could reuse that is at least
        MIN_GAIN tokens (once held: any) and one whole page longer than what the cache already
        gives it. The wait is one iteration per chunk the leader still needs for the shared part."""
        gain = 0
        if self.leaders:
            aligned = self.cache.prefix.aligned
            gain = max(aligned(self._reusable(req, leader)) for leader in self.leaders) - self.cached_len(req)
        held = gain > 0 and (req.held_for_prefix or gain >= MIN_GAIN)
        req.held_for_prefix = held
        return held

    def _reusable(self, req: Req, leader: Req) -> int:
        """Tokens of req's prompt that leader's prefill will put in the cache where req can hit them."""
        mine = req.token_ids[: min(req.prompt_len, self.cache.match_limit(req))]
        shared = common_prefix_len(mine, leader.token_ids[: leader.prompt_len])
        pa, pb = req.public_prefix_len, leader.public_prefix_len
        if self.cache.namespace(req) == self.cache.namespace(leader) and pa == pb:
            return shared
        return min(shared, pa, pb)  # only the public part is shared (0 unless both opted in)
