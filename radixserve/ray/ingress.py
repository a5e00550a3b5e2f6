"""`RadixServeIngress`: the HTTP ingress. It reads a request (method, the path below its route
prefix, query, headers, body up to --max-request-bytes), builds its Envelope with the routing
key, and calls RadixServeReplica.forward through a DeploymentHandle, whose
PrefixAwareRequestRouter picks the replica. The replica's status, headers and body come back
unchanged (plus an x-radixserve-replica header naming it).

Retries, and what "started" means: nothing is sent to the client before the replica's first
body chunk is here (a body with a Content-Length, i.e. every answer that is not streamed, is
read whole first). Until then a failed replica (its actor died, or it raised ReplicaGone) costs
the client nothing: the request goes to another replica, avoiding the failed ones, up to
`attempts` times in all, then a 503 with Retry-After. Once bytes went out (a stream began;
radixserve's streams begin when the request is admitted) an SSE stream ends with its API's
error event (errors.py); any other body without a Content-Length (radixserve sends none) has
its response raise, so it ends early. A client that leaves cancels the call, and the replica
closes its connection to its server, which aborts the request and frees its KV.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.ray.envelope import REQUEST_FRAMING, Envelope, Head, end_to_end, route_key
from radixserve.ray.errors import ReplicaGone, error_json, stream_error
from radixserve.server.body import too_large

log = logging.getLogger("ray.serve")
RETRYABLE = (ReplicaGone, RayActorError)  # a Ray task error from forward is also its cause's type


class _TooLarge(Exception):
    pass


@dataclass
class _Opened:
    """A request whose replica answered: its head, the body chunks read so far, the rest."""

    path: str
    head: Head
    chunks: list[bytes]
    complete: bool
    rest: DeploymentResponseGenerator


def _failure(e: BaseException) -> tuple[str | None, str]:
    """(the replica that failed, if known; why) of a retryable error."""
    cause = getattr(e, "cause", e)
    if isinstance(cause, ReplicaGone):
        return cause.replica, str(cause)
    return None, f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'the replica died'}"


def _local_path(request: Request) -> str:
    """The path below the application's route prefix (what the replica's server routes on)."""
    path, root = request.scope["path"], request.scope.get("root_path") or ""
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def _response(path: str, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_json(path, status, message, code), status, headers, media_type="application/json")


@serve.deployment(ray_actor_options={"num_cpus": 0})
class RadixServeIngress:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = 8 << 20, attempts: int = 3) -> None:
        self._replicas = replicas.options(stream=True)
        self.max_request_bytes, self.attempts = max_request_bytes, attempts

    async def __call__(self, request: Request) -> Response:
        path = _local_path(request) + (f"?{request.url.query}" if request.url.query else "")
        try:
            body = await self._body(request)
        except _TooLarge as e:
            err = too_large(self.max_request_bytes, e.args[0])
            return _response(path, 413, err.message, err.code or "request_too_large", {"Connection": "close"})
        headers = end_to_end(tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw), REQUEST_FRAMING)
        env = Envelope(request.method, path, headers, body, route_key(headers, body))
        try:
            opened = await self._open(env)
        except (BackPressureError, DeploymentUnavailableError) as e:
            return _response(path, 503, f"no radixserve replica can take the request now ({e})", "overloaded",
                             {"Retry-After": "1"})
        except Exception as e:
            log.exception("radixserve ingress: %s %s failed", request.method, path)
            return _response(path, 502, f"the radixserve replica failed: {type(e).__name__}: {e}", "replica_error")
        if opened is None:
            return _response(path, 503, f"no radixserve replica could serve the request after {self.attempts} attempts",
                             "replica_unavailable", {"Retry-After": "1"})
        hdrs = {k: v for k, v in opened.head.headers if k.lower() != "content-length"}
        if opened.complete:
            return Response(b"".join(opened.chunks), opened.head.status, hdrs)
        return StreamingResponse(self._stream(opened), opened.head.status, hdrs)

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise _TooLarge(int(declared))
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > self.max_request_bytes:
                raise _TooLarge(None)
        return bytes(buf)

    async def _open(self, env: Envelope) -> _Opened | None:
        """Send the request until a replica answers with a head and its first body bytes."""
        for attempt in range(1, self.attempts + 1):
            gen = cast(DeploymentResponseGenerator, self._replicas.forward.remote(env))
            try:
                head = await gen.__anext__()
                chunks, complete = await self._first(gen, head)
                return _Opened(env.path, head, chunks, complete, gen)
            except (*RETRYABLE, StopAsyncIteration) as e:
                gen.cancel()
                replica, why = _failure(e) if not isinstance(e, StopAsyncIteration) else (None, "an empty answer")
                log.warning("radixserve ingress: %s %s failed on a replica (attempt %d of %d): %s",
                            env.method, env.path, attempt, self.attempts, why)
                env = env.avoiding(replica)
            except BaseException:
                gen.cancel()
                raise
        return None

    @staticmethod
    async def _first(gen: DeploymentResponseGenerator, head: Head) -> tuple[list[bytes], bool]:
        """A body with a Content-Length whole; else its first chunk (or its end)."""
        if any(k.lower() == "content-length" for k, _ in head.headers):
            return [c async for c in gen], True
        try:
            return [await gen.__anext__()], False
        except StopAsyncIteration:
            return [], True

    async def _stream(self, opened: _Opened) -> AsyncIterator[bytes]:
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in opened.head.headers)
        events = 0
        try:
            for chunk in opened.chunks:
                events += chunk.count(b"\n\n")
                yield chunk
            async for chunk in opened.rest:
                events += chunk.count(b"\n\n")
                yield chunk
        except RETRYABLE as e:
            _, why = _failure(e)
            log.warning("radixserve ingress: a stream of %s broke off: %s", opened.path, why)
            if not sse:
                raise
            yield stream_error(opened.path, f"the radixserve replica serving this stream failed: {why}", "replica_failed",
                               events)
        finally:
            opened.rest.cancel()
