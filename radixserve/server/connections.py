"""Connection limits: what nginx's limit_conn and worker_connections do, which aiohttp lacks.

- At most `max_connections` open connections in all, and `max_connections_per_client` from one
  client address: a connection over either cap is answered 503 (JSON, `Retry-After`) and closed
  before any of it is read, so a flood of sockets cannot take every file descriptor. It is
  refused by the connection's first protocol (`_Gate`), before aiohttp builds a request handler
  for it. Over the per-client cap the 503 comes after `hold` seconds (the keep-alive timeout,
  at most HOLD_S), as nginx's limit_req delays, with at most half `max_connections` held at once
  (beyond that: at once): a client that reopens each refused connection at once (the abuse
  bench's idle connections, ~1,300 a second beside another tenant's chats) does so a fifth as
  often, and its churn no longer takes the CPU the engine's threads need.
- Idle connections, and connections whose request headers do not all arrive (slowloris), are
  closed after `keepalive_timeout` by aiohttp's keep-alive timer, which runs from the moment a
  connection opens and from the end of each response until the next request's headers are in.
- Slow bodies are bounded by `body_read_timeout` where the body is read (server/body.py).
"""

from __future__ import annotations

import asyncio
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
HOLD_S = 5.0  # the longest a connection over its client's cap waits for its 503


def _refusal(message: str) -> bytes:
    body = msgspec.json.encode(ErrorResponse(ErrorDetail(message, "overloaded_error", None, "too_many_connections")))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionLimits:
    def __init__(self, max_total: int, max_per_client: int, on_refuse: Callable[[], None] = lambda: None,
                 hold: float = 0.0) -> None:
        self.max_total, self.max_per_client = max_total, max_per_client
        self.on_refuse = on_refuse
        self.hold = min(hold, HOLD_S)  # seconds a connection over its client's cap waits for its 503
        self.held = 0
        self.by_client: Counter[str] = Counter()
        self._peer: dict[Any, str] = {}  # counted connection (its aiohttp handler) -> client address

    @property
    def open(self) -> int:
        return len(self._peer)

    def install(self, server: web.Server) -> None:
        """Hook the aiohttp server's connection bookkeeping (every connection it serves passes
        through it): the open connections, by client."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self._peer[handler] = _client(transport)
            self.by_client[self._peer[handler]] += 1

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            client = self._peer.pop(handler, None)
            if client is not None:
                self.by_client[client] -= 1
                if not self.by_client[client]:
                    del self.by_client[client]
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def refusal(self, transport: Any) -> str | None:
        """None when a new connection is within the caps, else why it is refused (counted)."""
        refused = self._over(_client(transport))
        if refused is not None:
            self.on_refuse()
        return refused

    def may_hold(self) -> bool:
        """Whether a refusal over a client's cap may wait `hold` seconds: fewer than half
        max_connections are held, and the server is not full."""
        return self.hold > 0 and self.open < self.max_total and self.held < self.max_total // 2

    def _over(self, client: str) -> str | None:
        if self.open >= self.max_total:
            return f"too many connections: {self.open} are open (max_connections {self.max_total}); retry later"
        if self.by_client[client] >= self.max_per_client:
            return (f"too many connections from {client}: {self.by_client[client]} are open "
                    f"(max_connections_per_client {self.max_per_client})")
        return None


def refuse(transport: Any, message: str) -> None:
    if not transport.is_closing():
        transport.write(_refusal(message))
        transport.close()


def _client(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class _Gate(asyncio.Protocol):
    """A connection's first protocol: over a cap it is refused here; within them the transport
    goes to a request handler of aiohttp's server, which serves it from then on."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server, self.limits = server, limits
        self.timer: asyncio.TimerHandle | None = None  # a held refusal's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        refused = self.limits.refusal(transport)
        if refused is None:
            handler = self.server()
            transport.set_protocol(handler)
            handler.connection_made(transport)
        elif self.limits.may_hold():
            self.limits.held += 1
            transport.pause_reading()  # type: ignore[attr-defined]
            self.timer = asyncio.get_running_loop().call_later(self.limits.hold, self._refuse, transport, refused)
        else:
            refuse(transport, refused)

    def _refuse(self, transport: asyncio.BaseTransport, message: str) -> None:
        self._release()
        refuse(transport, message)

    def _release(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.limits.held -= 1

    def data_received(self, data: bytes) -> None:  # a refused connection's bytes: never read
        pass

    def connection_lost(self, exc: Exception | None) -> None:  # a held one whose client left first
        self._release()


class _GatedFactory:
    """What the site opens its listener with: a gate per connection."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server, self.limits = server, limits

    def __call__(self) -> _Gate:
        return _Gate(self.server, self.limits)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server enforces ConnectionLimits."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self.limits.install(server)
        return server

    @property
    def server(self) -> Any:  # the sites' protocol factory (aiohttp's runner keeps its server as _server)
        return None if self._server is None else _GatedFactory(self._server, self.limits)


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
