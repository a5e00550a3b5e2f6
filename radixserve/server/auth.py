"""API keys -> tenants. Keys are compared in constant time and never logged.

`--api-key KEY`: one tenant ("default"). `--tenants FILE` (TOML or JSON):

    [[tenants]]                       {"tenants": [{"id": "acme", "api_key": "...", ...}]}
    id = "acme"
    api_key = "sk-acme-..."
    priority = 1                      # the tenant's class: default and highest request priority (omit: no cap)
    max_queued_requests = 32          # its share of the queue (over it: 429)
    max_cached_tokens = 200000        # its prefix-cache quota
    allow_public_prefix = true        # may hit and offer the shared public prefix
    admin = false                     # may flush the whole prefix cache (POST /flush_cache)

No key configured: every request is the default tenant.
"""

from __future__ import annotations

import hmac
import json
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

    def __repr__(self) -> str:  # never show the key
        return f"Tenant({self.id!r}, priority={self.priority})"


class _TenantsFile(msgspec.Struct, forbid_unknown_fields=True):
    tenants: list[Tenant]


OPEN_TENANT = Tenant(DEFAULT_TENANT, allow_public_prefix=True, admin=True)


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
            return cls([Tenant(DEFAULT_TENANT, api_key=api_key, allow_public_prefix=True, admin=True)])
        if tenants_file:
            return cls(load_tenants(Path(tenants_file)))
        return cls()

    @property
    def open(self) -> bool:
        return not self._keys

    def of_request(self, request: web.Request) -> Tenant:
        """The tenant of a request's key (a 401 without a valid one), noted in its access-log entry."""
        tenant = self.authenticate(request.headers.get("Authorization"), request.headers.get("x-api-key"))
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
