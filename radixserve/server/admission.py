"""Admission control: a request counts as queued from acceptance until its first token; the
global queue and each tenant's share are capped. Rejections are decided at once, before any
tokenization or engine work, so overload costs the client one round trip."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from radixserve.engine.outputs import Output
from radixserve.server.auth import Tenant
from radixserve.server.errors import ApiError


@dataclass
class Ticket:
    """One admitted request's place in the queue. Only `leave` frees it, and only once."""

    tenant: str
    queued: bool = True
    left: bool = False
    ran: bool = False  # handed to the engine (its run counts its use)
    out: Output | None = None  # its final output, once it ran to the end


def request_priority(tenant: Tenant, requested: int | None) -> int:
    """A tenant's class caps its requests' priority and is their default; no class: free choice."""
    if tenant.priority is None:
        return requested or 0
    return tenant.priority if requested is None else min(requested, tenant.priority)


class Admission:
    def __init__(self, max_queued: int, retry_after_s: int = 1) -> None:
        self.max_queued = max_queued
        self.retry_after = str(retry_after_s)
        self.queued = 0
        self.in_flight = 0
        self.by_tenant: Counter[str] = Counter()  # queued, per tenant
        self.in_flight_by_tenant: Counter[str] = Counter()
        self.draining = False

    def check(self, tenant: Tenant, n: int = 1) -> None:
        """Whether n more requests would be admitted now, or the ApiError: 503 draining or globally
        full, 429 over the tenant's share. Routes check before reading the body, so under
        overload a rejection costs no await (it never queues behind the burst again)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": self.retry_after})
        if self.queued + n > self.max_queued:
            raise ApiError(503, f"overloaded: {self.queued} requests are queued (max {self.max_queued}); retry later",
                           code="overloaded", headers={"Retry-After": self.retry_after})
        cap = tenant.max_queued_requests
        if cap is not None and self.by_tenant[tenant.id] + n > cap:
            raise ApiError(429, f"tenant {tenant.id!r} has {self.by_tenant[tenant.id]} requests queued (max {cap})",
                           code="tenant_queue_full", headers={"Retry-After": self.retry_after})

    def enter(self, tenant: Tenant, n: int = 1, field: str = "n") -> list[Ticket]:
        """n tickets (n > 1 for siblings of one call), or an ApiError (see `check`; 400 naming
        `field`, what made the call n requests, if n could never be admitted)."""
        if n > self.max_queued or (tenant.max_queued_requests is not None and n > tenant.max_queued_requests):
            cap = min(self.max_queued, tenant.max_queued_requests or self.max_queued)
            raise ApiError(400, f"{field}: {n} requests at once can never be admitted (the queue takes {cap})", param=field)
        self.check(tenant, n)
        self.queued += n
        self.in_flight += n
        self.by_tenant[tenant.id] += n
        self.in_flight_by_tenant[tenant.id] += n
        return [Ticket(tenant.id) for _ in range(n)]

    def started(self, t: Ticket) -> None:
        """The request produced its first token: it no longer counts as queued."""
        if t.queued:
            t.queued = False
            self.queued -= 1
            self.by_tenant[t.tenant] -= 1

    def leave(self, t: Ticket) -> None:
        if t.left:
            return
        self.started(t)
        t.left = True
        self.in_flight -= 1
        self.in_flight_by_tenant[t.tenant] -= 1
