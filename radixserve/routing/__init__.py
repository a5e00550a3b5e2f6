"""Routing requests to data-parallel replicas (pure Python): `make_router(RouterConfig)` is the
registry of policies; `PrefixIndex` the approximate per-replica prefix index they share."""

from radixserve.routing.index import PrefixIndex, block_hashes
from radixserve.routing.policy import RouteKey, Router, make_router

__all__ = ["PrefixIndex", "RouteKey", "Router", "block_hashes", "make_router"]
