"""Per-tenant compile queues: who gets the next free worker.

A tenant runs at most `limit` compiles at once; its further compiles wait in its own queue.
A free worker goes to the tenant with the fewest compiles running, ties to the one whose
head compile has waited longest, so one tenant's slow grammars never starve another's.
A compile belongs to one tenant (the compile cache is per tenant).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterator


class Waiting:
    """A compile not yet started. `queued_at`: monotonic seconds when it was first queued."""

    def __init__(self, queued_at: float) -> None:
        self.queued_at = queued_at
        self.taken = False  # started, or dropped (expired, shut down)
        self.tenant: Hashable = None


class TenantQueues:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"grammar_tenant_compiles: must be at least 1, got {limit}")
        self.limit = limit
        self.running: Counter[Hashable] = Counter()
        self._queues: dict[Hashable, deque[Waiting]] = {}

    def push(self, w: Waiting, tenant: Hashable) -> None:
        w.tenant = tenant
        self._queues.setdefault(tenant, deque()).append(w)

    def pop(self) -> tuple[Waiting, Hashable] | None:
        """The next compile to start and the tenant it runs for (its running count goes up)."""
        best = None
        for tenant, q in self._queues.items():
            head = self._head(q)
            if head is None or self.running[tenant] >= self.limit:
                continue
            rank = (self.running[tenant], head.queued_at)
            if best is None or rank < best[0]:
                best = (rank, tenant)
        if best is None:
            return None
        tenant = best[1]
        w = self._queues[tenant].popleft()
        w.taken = True
        self.running[tenant] += 1
        self._forget_empty()
        return w, tenant

    def finished(self, tenant: Hashable) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]

    def runnable(self) -> int:
        """About how many compiles could start now if there were workers (for starting workers)."""
        return sum(min(sum(1 for w in q if not w.taken), self.limit - self.running[t]) for t, q in self._queues.items())

    def remove(self, w: Waiting) -> None:
        w.taken = True  # dropped from its queue lazily
        q = self._queues.get(w.tenant)
        if q is not None:
            self._head(q)
        self._forget_empty()

    def waiting(self) -> Iterator[Waiting]:
        for q in self._queues.values():
            yield from (w for w in q if not w.taken)

    def is_runnable(self, w: Waiting) -> bool:
        return self.running[w.tenant] < self.limit

    def _head(self, q: deque[Waiting]) -> Waiting | None:
        while q and q[0].taken:
            q.popleft()
        return q[0] if q else None

    def _forget_empty(self) -> None:
        for t in [t for t, q in self._queues.items() if not q]:
            del self._queues[t]
