"""Which replica a request goes to. `Router.choose(key, loads)` sees the request's routing key
(namespace, the start of its prompt, the client's prompt_cache_key) and the healthy replicas'
loads (requests in flight on each), and returns one of them.

`prefix` is SGLang's cache-aware policy (sgl-router; Ray's PrefixCacheAffinityRouter works
the same way), on an approximate per-replica prefix index (index.py):

1. load unbalanced (busiest - idlest > abs threshold, and busiest > rel threshold x idlest):
   the least loaded replica;
2. else a prompt_cache_key seen before in this namespace: the replica it went to;
3. else the replica matching most of the prompt's first blocks, when that match is at least
   `router_cache_threshold` of them;
4. else (a new prefix) the replica whose index holds the fewest blocks (the most room), the
   least loaded of those.

The choice is recorded at once (before the request runs), so 16 forks sent together all
follow the first to one replica. `round_robin`, `random` and `least_loaded` are the
baselines (bench route compares them).
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from radixserve.config import RouterConfig
from radixserve.routing.index import PrefixIndex, Replica, block_hashes

CHARS_PER_TOKEN = 4  # where a router sees text, not tokens (Ray Serve's handle), blocks are this many times longer
MAX_HINTS = 100_000  # prompt_cache_key -> replica entries kept (LRU)


@dataclass(frozen=True)
class RouteKey:
    namespace: Hashable  # (tenant, cache_salt): prefixes of different namespaces never match
    prefix: Sequence[int] | str  # the prompt's tokens, or its text where the router cannot tokenize
    hint: str | None = None  # OpenAI's prompt_cache_key: requests the client says share a prefix


class Router(ABC):
    """Decisions are counted by reason (`decisions`), for /server_info and the benchmark."""

    name: str

    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()

    @abstractmethod
    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        """One of `loads`' replicas (the healthy ones, never empty) for this request."""

    def forget(self, replica: Replica) -> None:  # noqa: B027 (the stateless policies keep nothing to forget)
        """The replica died or restarted cold: whatever was routed there is gone."""


class PrefixAffinity(Router):
    name = "prefix"

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = PrefixIndex(cfg.router_max_blocks_per_replica)
        self._hints: OrderedDict[tuple[Hashable, str], Replica] = OrderedDict()

    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        cfg = self.cfg
        scale = CHARS_PER_TOKEN if isinstance(key.prefix, str) else 1
        block = cfg.router_block_tokens * scale
        hashes = block_hashes(key.namespace, key.prefix, block, cfg.router_max_prefix_tokens // cfg.router_block_tokens)
        hint = (key.namespace, key.hint) if key.hint is not None else None
        if self._unbalanced(loads):
            choice, why = min(loads, key=loads.__getitem__), "balance"
        elif hint is not None and self._hints.get(hint) in loads:
            choice, why = self._hints[hint], "hint"
        else:
            depth = self.index.match(hashes, loads)
            best = max(loads, key=lambda r: (depth[r], -loads[r]))
            keyed = min(len(key.prefix), cfg.router_max_prefix_tokens * scale)
            if depth[best] and depth[best] * block >= cfg.router_cache_threshold * keyed:
                choice, why = best, "prefix"
            else:
                choice, why = min(loads, key=lambda r: (self.index.size(r), loads[r])), "fresh"
        self.index.insert(choice, hashes)
        if hint is not None:
            self._hints[hint] = choice
            self._hints.move_to_end(hint)
            if len(self._hints) > MAX_HINTS:
                self._hints.popitem(last=False)
        self.decisions[why] += 1
        return choice

    def _unbalanced(self, loads: Mapping[Replica, int]) -> bool:
        lo, hi = min(loads.values()), max(loads.values())
        return hi - lo > self.cfg.router_balance_abs_threshold and hi > self.cfg.router_balance_rel_threshold * lo

    def forget(self, replica: Replica) -> None:
        self.index.forget(replica)
        for k in [k for k, r in self._hints.items() if r == replica]:
            del self._hints[k]


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self._next = itertools.count()

    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        replicas = list(loads)
        self.decisions["round_robin"] += 1
        return replicas[next(self._next) % len(replicas)]


class Random(Router):
    name = "random"

    def __init__(self, cfg: RouterConfig, seed: int | None = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        self.decisions["random"] += 1
        return self._rng.choice(list(loads))


class LeastLoaded(Router):
    name = "least_loaded"

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()

    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        self.decisions["least_loaded"] += 1
        return min(loads, key=loads.__getitem__)


POLICIES: dict[str, Callable[[RouterConfig], Router]] = {c.name: c for c in (PrefixAffinity, RoundRobin, Random, LeastLoaded)}


def make_router(cfg: RouterConfig) -> Router:
    """The router named by cfg.router_policy (config.ROUTER_POLICIES lists the same names)."""
    cfg.check()
    return POLICIES[cfg.router_policy](cfg)
