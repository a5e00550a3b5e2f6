"""`PrefixAwareRequestRouter`: Ray Serve's request-router API (ray.serve.request_router) as an
adapter over radixserve.routing, the policy the data-parallel engine runs too.

Ray calls `choose_replicas(candidates, pending_request)` for each handle call to
RadixServeReplica.forward; the call's first argument is the ingress's Envelope, whose `key`
is the routing key. The answer is ranked, as Ray expects: `[[chosen], [the others]]`; Ray sends
to the first rank whose replica has room (fewer than max_ongoing_requests), so the others are
the fallback when the chosen one is full. A call without a key (no JSON body) gets every
candidate as one rank: Ray takes the least loaded.

Loads (the policy's "requests in flight") are Ray's queue-length cache: what each replica last
reported as its ongoing requests (all handles' requests, so several ingress replicas see each
other's), counted up as this handle sends and down as requests complete; a replica without a
fresh entry (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S, 10 s) is probed, as Ray's own routers do,
and one that does not answer in time is left out of this choice.

Dead replicas: Ray drops a replica whose actor died (ActorDiedError) and the controller removes
one whose health check failed; either way the policy forgets what it routed there. A replica
whose engine died while its actor lives answers ReplicaGone at once, and the ingress retries the
request with that replica in `Envelope.avoid`: the router then avoids it for every request
until the controller replaces it (or SUSPECT_S passes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from ray.exceptions import ActorDiedError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.config import RouterConfig
from radixserve.ray.envelope import Envelope
from radixserve.routing import Router, make_router

log = logging.getLogger("ray.serve")
SUSPECT_S = 60.0  # how long a replica that failed a request is avoided, unless Ray replaces it sooner
PROBE_TIMEOUT_S = 1.0  # a queue-length probe's deadline


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, **router_options: object) -> None:
        """Ray passes RequestRouterConfig.request_router_kwargs: RouterConfig's fields."""
        self.policy: Router = make_router(RouterConfig(**router_options))  # type: ignore[arg-type]
        self._suspects: dict[str, float] = {}  # replica unique id -> avoided until (monotonic)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        env = _envelope(pending_request)
        live = self._live(candidate_replicas, env.avoid if env is not None else frozenset())
        if env is None or env.key is None or not live:
            return [live]
        room = self.select_available_replicas(live) or live
        loads = await self._loads(room)
        if not loads:
            return [live]
        choice = self.policy.choose(env.key, loads)
        chosen = next(r for r in live if r.replica_id.unique_id == choice)
        return [[chosen], [r for r in live if r is not chosen]]

    def _live(self, candidates: Sequence[RunningReplica], avoid: frozenset[str]) -> list[RunningReplica]:
        """The candidates minus the replicas a request failed on (all of them if none is left)."""
        now = time.monotonic()
        for uid in avoid:
            if uid not in self._suspects:
                log.warning("radixserve router: avoiding replica %s (a request failed there)", uid)
                self.policy.forget(uid)
            self._suspects[uid] = now + SUSPECT_S
        for uid in [u for u, until in self._suspects.items() if until < now]:
            del self._suspects[uid]
        live = [r for r in candidates if r.replica_id.unique_id not in self._suspects]
        return live or list(candidates)

    async def _loads(self, replicas: Sequence[RunningReplica]) -> dict[str, int]:
        cache = self.replica_queue_len_cache
        loads: dict[str, int] = {}
        stale = []
        for r in replicas:
            n = cache.get(r.replica_id)
            if n is None:
                stale.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if stale:
            loads.update(await self._probe(stale))
        return loads

    async def _probe(self, replicas: Sequence[RunningReplica]) -> dict[str, int]:
        tasks = {asyncio.ensure_future(r.get_queue_len(deadline_s=PROBE_TIMEOUT_S)): r for r in replicas}
        done, pending = await asyncio.wait(tasks, timeout=PROBE_TIMEOUT_S)
        for t in pending:
            t.cancel()
        out: dict[str, int] = {}
        for t in done:
            r = tasks[t]
            if t.exception() is None:
                out[r.replica_id.unique_id] = t.result()
                self.replica_queue_len_cache.update(r.replica_id, t.result())
            elif isinstance(t.exception(), ActorDiedError):
                self.on_replica_actor_died(r.replica_id)
        return out

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The controller's replica set: replicas that left (stopped, or replaced after a
        failed health check) are forgotten; a replacement comes with a new id and a cold cache."""
        old = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        for uid in old - {rid.unique_id for rid in self.curr_replicas}:
            self.policy.forget(uid)
            self._suspects.pop(uid, None)


def _envelope(pending: PendingRequest | None) -> Envelope | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], Envelope):
        return None
    return pending.args[0]
