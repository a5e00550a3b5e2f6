"""API keys -> tenants. Keys are compared in constant time and never logged.

`--api-key KEY`: one tenant ("default"). `--tenants FILE` (TOML or JSON):

    [[tenants]]                       {"tenants": [{"id": "acme", "api_key": "...", ...}]}
    id = "acme"
    api_key = "sk-acme-..."
    priority = 1                      # the tenant's class: default and highest request priority (omit: no cap)
    max_queued_requests = 32          # its share of the queue (over it: 429)
    max_cached_tokens = 200000        # its prefix-cache quota
    allow_public_prefix = true        # may hit and offer the shared public prefix
    admin = false                     # may flush the whole prefix cache (POST /flush_cache), sees every tenant's counters
    max_cache_retention = "1h"        # the longest retention it may ask (prompt_cache_retention, cache_control
                                      # ttl): a duration such as "90s", "5m", "1h", "24h"; omitted: "5m"
    max_requests_per_second = 20      # its request rate, counted before any body is read (over it: a paced 429;
    max_request_burst = 40            # server/rate_limit.py); the burst: omitted, one second's worth

No key configured: every request is the default tenant. It, and `--api-key`'s one tenant, may
ask any retention. A tenant's prefix-cache namespaces (pool and disk tier) are keyed by a
digest of its key as well as its id: a tenant id issued again with a new key starts with an
empty cache, and so does a rotated key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import tomllib
from pathlib import Path

import msgspec
from aiohttp import web

from radixserve.cache.prefix import DEFAULT_TENANT
from radixserve.server import access_log
from radixserve.server.errors import ApiError


class Tenant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    api_key: str | None = None
    priority: int | None = None  # None: requests choose freely; else their default and their cap
    max_queued_requests: int | None = None
    max_cached_tokens: int | None = None
    allow_public_prefix: bool = False
    admin: bool = False  # may flush the whole prefix cache
    max_cache_retention: str | None = None  # a duration (DURATION); None: DEFAULT_RETENTION
    max_requests_per_second: float | None = None  # None: no rate limit
    max_request_burst: int | None = None  # None: a second's worth (at least 1)

    def __post_init__(self) -> None:
        if self.max_requests_per_second is not None and not 0 < self.max_requests_per_second < float("inf"):
            raise ValueError(f"max_requests_per_second: must be a positive number, got {self.max_requests_per_second}")
        if self.max_request_burst is not None and self.max_request_burst < 1:
            raise ValueError(f"max_request_burst: must be a positive integer, got {self.max_request_burst}")
        if self.max_cache_retention is not None and duration_seconds(self.max_cache_retention) is None:
            raise ValueError(f"max_cache_retention: {self.max_cache_retention!r} is not a duration such as "
                             "\"90s\", \"5m\", \"1h\" or \"24h\"")

    @property
    def request_burst(self) -> int:
        """Requests it may send at once over its rate."""
        return self.max_request_burst or max(1, math.ceil(self.max_requests_per_second or 1))

    @property
    def retention_cap(self) -> int:
        """The longest retention, in seconds, its requests may ask."""
        return duration_seconds(self.max_cache_retention or DEFAULT_RETENTION) or 0

    @property
    def namespace_key(self) -> str | None:
        """A digest of its key (never the key) that keys its cache namespaces with its id."""
        if not self.api_key:
            return None
        return hashlib.sha256(b"radixserve namespace\0" + self.api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]

    @property
    def owner(self) -> str:
        """Who owns its stored Responses: its id and the digest of its key, so a tenant id issued
        again with a new key (or a rotated key) reads none of the old owner's conversations."""
        key = self.namespace_key
        return self.id if key is None else f"{self.id}/{key}"

    def __repr__(self) -> str:  # never show the key
        return f"Tenant({self.id!r}, priority={self.priority})"


DURATION = re.compile(r"([0-9]{1,7})([smhd])")
DEFAULT_RETENTION = "5m"  # Anthropic's default cache_control TTL: what any tenant may ask
ANY_RETENTION = "24h"  # the longest any API asks (request.RETENTIONS)


def duration_seconds(text: str) -> int | None:
    """"90s", "5m", "1h", "2d" in seconds; None for another text."""
    m = DURATION.fullmatch(text) if isinstance(text, str) else None
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] if m else None


TENANT_KEY = "radixserve.tenant"  # a request's tenant once authenticated (server/rate_limit.middleware)


class _TenantsFile(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[Tenant]


OPEN_TENANT = Tenant(DEFAULT_TENANT, allow_public_prefix=True, admin=True, max_cache_retention=ANY_RETENTION)


class Auth:
    def __init__(self, tenants: list[Tenant] | None = None) -> None:
        self.tenants = tenants or []
        if any(not t.api_key for t in self.tenants):
            raise ValueError("tenants: every tenant needs a non-empty api_key")
        ids = [t.id for t in self.tenants]
        if len(set(ids)) != len(ids) or len({t.api_key for t in self.tenants}) != len(ids):
            raise ValueError("tenants: tenant ids and api keys must be unique")
        self._keys = [(t.api_key.encode(), t) for t in self.tenants if t.api_key]

    @classmethod
    def from_options(cls, api_key: str | None, tenants_file: str | None) -> Auth:
        if api_key and tenants_file:
            raise ValueError("--api-key and --tenants are exclusive")
        if api_key:
            return cls([Tenant(DEFAULT_TENANT, api_key=api_key, allow_public_prefix=True, admin=True,
                               max_cache_retention=ANY_RETENTION)])
        if tenants_file:
            return cls(load_tenants(Path(tenants_file)))
        return cls()

    @property
    def open(self) -> bool:
        return not self._keys

    def of_request(self, request: web.Request) -> Tenant:
        """The tenant of a request's key (a 401 without a valid one), noted in its access-log entry."""
        tenant = request.get(TENANT_KEY) or self.authenticate(request.headers.get("Authorization"),
                                                              request.headers.get("x-api-key"))
        if (entry := access_log.CURRENT.get()) is not None:
            entry.tenant = tenant.id
        return tenant

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> Tenant:
        if self.open:
            return OPEN_TENANT
        key = request_key(authorization, x_api_key)
        if not key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        given, found = key.encode("utf-8", "surrogateescape"), None
        for k, tenant in self._keys:  # compare against every key: no early exit to time
            if hmac.compare_digest(given, k):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return found


def request_key(authorization: str | None, x_api_key: str | None = None) -> str | None:
    """The key a request sends: `Authorization: Bearer <key>`, else `x-api-key`."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return x_api_key


def load_tenants(path: Path) -> list[Tenant]:
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
        return msgspec.convert(data, _TenantsFile).tenants
    except (OSError, ValueError, msgspec.ValidationError) as e:
        raise ValueError(f"tenants file {path}: {e}") from None
