"""Per-tenant request rate limits (tenants.toml `max_requests_per_second`, `max_request_burst`):
the generic cell rate algorithm, as nginx's `limit_req` and most API gateways apply it.

Every request of a limited tenant is counted when its headers have arrived, before its body is
read and whatever it asks, so a flood of requests that would be refused anyway (a retention
the tenant may not ask, a malformed body) costs the server no more than the tenant's rate of
them. A body counts one request more for every REQUEST_UNIT_BYTES it declares (a chunked one,
once read), as an API's tokens-per-minute limit counts a long prompt: reading and decoding a
1.4 MiB body costs the server tens of milliseconds, a chat's a fraction of one; a request
never counts more than the burst. Over the rate (its burst spent) a request gets a 429 `rate_limited` with Retry-After, and
that refusal is paced: it is answered when the tenant's next request would be allowed (at most
MAX_PACE_S later), so a client that retries at once sends no faster than it may. A request with
a body still unread is refused on a connection that then closes (no draining of a 6 MiB body
nobody will read). A refused request takes nothing from the tenant's allowance.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from radixserve.server.auth import TENANT_KEY, Tenant
from radixserve.server.errors import ApiError

MAX_PACE_S = 1.0  # the longest a refusal waits before it is answered
REQUEST_UNIT_BYTES = 1 << 16  # a body counts one request more for each 64 KiB


def units(body_bytes: int) -> int:
    """Requests' worth a body of this many bytes counts for."""
    return 1 + body_bytes // REQUEST_UNIT_BYTES


class RateLimiter:
    """One GCRA cell per limited tenant: `tat` is when its allowance is next wholly spent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tat: dict[str, float] = {}

    def wait(self, tenant: Tenant, n: int = 1) -> float:
        """0.0 and n requests counted (at most the burst), or the seconds until they would be
        allowed (nothing counted)."""
        rate = tenant.max_requests_per_second
        if rate is None:
            return 0.0
        n = min(n, tenant.request_burst)
        now, interval = self.clock(), 1.0 / rate
        tolerance = (tenant.request_burst - 1) * interval
        tat = max(self._tat.get(tenant.id, now), now)
        excess = (tat - now) + (n - 1) * interval - tolerance  # > 0: the last of the n would come too early
        if excess > 1e-9:  # (clocks run in the thousands of seconds: one subtraction, a tolerance for rounding)
            return excess
        self._tat[tenant.id] = tat + n * interval
        return 0.0

    def charge(self, tenant: Tenant, n: int) -> None:
        """Count n more requests of a request already let in (a chunked body, once read): the
        tenant's next ones wait for them."""
        if tenant.max_requests_per_second is None or n <= 0:
            return
        now = self.clock()
        n = min(n, tenant.request_burst)
        self._tat[tenant.id] = max(self._tat.get(tenant.id, now), now) + n / tenant.max_requests_per_second

    async def admit(self, tenant: Tenant, n: int = 1) -> None:
        """Count n requests' worth of `tenant`, or raise the paced 429."""
        wait = self.wait(tenant, n)
        if wait <= 0:
            return
        pace = min(wait, MAX_PACE_S)
        await asyncio.sleep(pace)
        rate = tenant.max_requests_per_second
        raise ApiError(429, f"rate limit: tenant {tenant.id!r} may send {rate:g} requests a second (a burst of "
                            f"{tenant.request_burst}); retry in {max(wait - pace, 0.0):.2f} s",
                       code="rate_limited", headers={"Retry-After": str(math.ceil(max(wait - pace, 0.0)))})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authenticate a request once (on an open server, or when it carries a key), and count it
    against its tenant's rate; a request without a valid key goes on to its route, which answers
    it (401, or an open route). The routes read the tenant found here (auth.TENANT_KEY)."""
    state = request.app["state"]
    authorization, api_key = request.headers.get("Authorization"), request.headers.get("x-api-key")
    if authorization or api_key or state.auth.open:
        try:
            tenant = state.auth.of_request(request)
        except ApiError:
            return await handler(request)
        request[TENANT_KEY] = tenant
        await state.rate_limiter.admit(tenant, units(request.content_length or 0))
    return await handler(request)
