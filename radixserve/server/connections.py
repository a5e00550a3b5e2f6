"""Connection limits: what nginx's limit_conn and worker_connections do, which aiohttp lacks.

- At most `max_connections` open connections in all, and `max_connections_per_client` from one
  client address: a connection over either cap is answered 503 (JSON, `Retry-After`) and closed
  before any of it is read, so a flood of sockets cannot take every file descriptor.
- Idle connections, and connections whose request headers do not all arrive (slowloris), are
  closed after `keepalive_timeout` by aiohttp's keep-alive timer, which runs from the moment a
  connection opens and from the end of each response until the next request's headers are in.
- Slow bodies are bounded by `body_read_timeout` where the body is read (server/body.py).
"""

from __future__ import annotations

import logging
import resource
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from radixserve.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)
FD_RESERVE = 512  # descriptors kept for everything but client sockets (model files, logs, compile workers)


def _refusal(message: str) -> bytes:
    body = msgspec.json.encode(ErrorResponse(ErrorDetail(message, "overloaded_error", None, "too_many_connections")))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionLimits:
    def __init__(self, max_total: int, max_per_client: int, on_refuse: Callable[[], None] = lambda: None) -> None:
        self.max_total, self.max_per_client = max_total, max_per_client
        self.on_refuse = on_refuse
        self.by_client: Counter[str] = Counter()
        self._peer: dict[Any, str] = {}  # counted connection (its aiohttp handler) -> client address

    @property
    def open(self) -> int:
        return len(self._peer)

    def install(self, server: web.Server) -> None:
        """Hook the aiohttp server's connection bookkeeping (every connection passes through it)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            refused = self._over(client)
            if refused:
                self.on_refuse()
                transport.write(_refusal(refused))
                transport.close()
                return
            self._peer[handler] = client
            self.by_client[client] += 1

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            client = self._peer.pop(handler, None)
            if client is not None:
                self.by_client[client] -= 1
                if not self.by_client[client]:
                    del self.by_client[client]
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def _over(self, client: str) -> str | None:
        if self.open >= self.max_total:
            return f"too many connections: {self.open} are open (max_connections {self.max_total}); retry later"
        if self.by_client[client] >= self.max_per_client:
            return (f"too many connections from {client}: {self.by_client[client]} are open "
                    f"(max_connections_per_client {self.max_per_client})")
        return None


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server enforces ConnectionLimits."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self.limits.install(server)
        return server


def fit_fd_limit(max_connections: int) -> int:
    """Raise the soft descriptor limit so max_connections fit beside FD_RESERVE; if the hard
    limit is too low for that, lower the connection cap instead. Returns the cap in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft < want:
        fitted = max(soft - FD_RESERVE, 16)
        log.warning("max_connections %d does not fit the descriptor limit %d; using %d", max_connections, soft, fitted)
        return fitted
    return max_connections
