"""`RadixServeReplica`: one Ray Serve replica = one whole radixserve server (its own engine
process and KV cache) on 127.0.0.1, to which `forward` proxies a request unchanged.

`forward(envelope)` streams a Head (the server's status and headers), then the body as it comes.
It raises ReplicaGone (the ingress then retries elsewhere, if nothing went out yet) when the
server is gone, refuses the connection, breaks a response off, or answers a 5xx while its
/health says it cannot serve (its engine died: it fails what it held and exits). A 4xx, or a
503/429 of a healthy server (overload, a tenant over quota), is the answer, passed back as is.
When the caller goes (the client disconnected, Ray cancels the call), the connection to the
server is closed, and the server aborts the request and frees its KV.

`check_health` (Ray Serve calls it every health_check_period_s) fails once the server exited
or its /health is not 200, so the controller replaces the replica and routers stop sending to
it. `record_routing_stats` (Ray's routing-stats hook) reports the engine's KV and prefill
counters; `record_autoscaling_stats` (Ray's custom-metrics hook) the autoscaling signals
(requests waiting, their tokens, running, KV usage, TTFT per 1k prompt tokens: autoscale.py). A replica logs its cold start:
from its actor's start to its server ready, and to its first answer. The server is stopped
(drained) when Serve shuts the replica down, and killed with the replica process otherwise
(local_server.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from ray import serve

from radixserve.ray.autoscale import SIGNALS
from radixserve.ray.envelope import RESPONSE_OWN, Envelope, Head, end_to_end
from radixserve.ray.errors import ReplicaGone
from radixserve.ray.local_server import replica_server
from radixserve.ray.options import ReplicaSpec

log = logging.getLogger("ray.serve")
HEALTH_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
REPLICA_HEADER = "x-radixserve-replica"


@serve.deployment(ray_actor_options={"num_cpus": 1})
class RadixServeReplica:
    def __init__(self, spec: ReplicaSpec, start_timeout: float = 600.0) -> None:
        self._born, born_at = time.monotonic(), time.time()
        self.id = serve.get_replica_context().replica_id.unique_id
        self._admin_key = spec.admin_key()
        self.server = replica_server(spec, start_timeout)
        self._session: aiohttp.ClientSession | None = None
        self.cold_start: dict[str, float] = {"started_at": born_at, "server_ready_s": round(time.monotonic() - self._born, 3)}
        log.info("radixserve replica %s: server %s (pid %s) ready %.2f s after the replica started", self.id,
                 self.server.url, self.server.pid, self.cold_start["server_ready_s"])

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # made on the replica's event loop, on first use
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                                  auto_decompress=False)
        return self._session

    async def forward(self, env: Envelope) -> AsyncIterator[Head | bytes]:
        if (why := self.server.gone()) is not None:
            raise ReplicaGone(self.id, why)
        try:
            resp = await self._client().request(env.method, f"{self.server.url}{env.path}", headers=list(env.headers),
                                                data=env.body or None, allow_redirects=False)
        except aiohttp.ClientError as e:
            raise ReplicaGone(self.id, self.server.gone() or f"its radixserve server did not answer ({e!r})") from None
        complete = False
        try:
            if resp.status >= 500 and (why := await self._cannot_serve()) is not None:
                raise ReplicaGone(self.id, why)
            yield Head(resp.status, (*end_to_end(resp.headers, RESPONSE_OWN), (REPLICA_HEADER, self.id)), self.id)
            async for chunk in resp.content.iter_any():
                if "first_answer_s" not in self.cold_start and resp.status == 200:
                    self.cold_start["first_answer_s"] = round(time.monotonic() - self._born, 3)
                    log.info("radixserve replica %s: cold start: first answer %.2f s after the replica started (server "
                             "ready at %.2f s)", self.id, self.cold_start["first_answer_s"], self.cold_start["server_ready_s"])
                yield chunk
            complete = True
        except aiohttp.ClientError as e:
            raise ReplicaGone(self.id, self.server.gone() or f"the response broke off ({e!r})") from None
        finally:
            if complete:
                resp.release()
            else:
                resp.close()  # the server sees its client gone, aborts the request and frees its KV

    async def _cannot_serve(self) -> str | None:
        """Why this replica cannot serve now (its server exited, its /health is not 200), or None."""
        if (why := self.server.gone()) is not None:
            return why
        try:
            async with self._client().get(f"{self.server.url}/health", timeout=aiohttp.ClientTimeout(HEALTH_TIMEOUT_S)) as r:
                if r.status != 200:
                    return f"its radixserve server is not healthy ({r.status} {(await r.text())[:200]})"
        except (aiohttp.ClientError, TimeoutError) as e:
            return self.server.gone() or f"its radixserve server does not answer /health ({e!r})"
        return None

    async def check_health(self) -> None:
        if (why := await self._cannot_serve()) is not None:
            raise RuntimeError(f"radixserve replica {self.id}: {why}")

    async def _server_info(self) -> dict[str, Any]:
        """The server's /server_info as an admin sees it (with an admin key, or no key configured);
        {} if it does not answer."""
        headers = {"Authorization": f"Bearer {self._admin_key}"} if self._admin_key else {}
        try:
            async with self._client().get(f"{self.server.url}/server_info", headers=headers,
                                          timeout=aiohttp.ClientTimeout(HEALTH_TIMEOUT_S)) as r:
                if r.status == 200:
                    info: dict[str, Any] = await r.json()
                    return info
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return {}

    async def record_routing_stats(self) -> dict[str, Any]:
        """The replica's server: its URL and pids, its cold start, and its engine's counters as
        /server_info's `kv` (prefill_tokens_computed, running, ...)."""
        info = await self._server_info()
        return {"replica": self.id, "url": self.server.url, "server_pid": self.server.pid,
                "engine_pid": info.get("engine_pid"), "kv": info.get("kv"), "cold_start": self.cold_start}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaling signals (autoscale.SIGNALS) from /server_info's `autoscaling`."""
        signals = (await self._server_info()).get("autoscaling") or {}
        return {name: float(signals.get(name, 0.0)) for name in SIGNALS}

    def __del__(self) -> None:
        """Serve's graceful shutdown: the server drains (what runs already finished: Serve waits
        for ongoing requests first)."""
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
        session = getattr(self, "_session", None)
        if session is not None and not session.closed:
            try:
                asyncio.get_running_loop().create_task(session.close())
            except RuntimeError:  # no loop (garbage collection): the process is going anyway
                pass
