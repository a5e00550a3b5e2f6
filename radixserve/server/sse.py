"""Server-sent events: `data: <json>` per chunk, `data: [DONE]` at the end. A write that waits
longer than the stream write timeout on a client that stopped reading counts as a vanished
client: the handler leaves, which aborts the request and frees its KV.

NOTE: what a client that does not read can leave unsent is bounded here, not by the kernel's
defaults: Linux grows a socket's send buffer up to tcp_wmem's maximum (4 MiB), enough for a
whole long answer on loopback, so without a bound an unread stream was decoded to its end with
no write ever waiting. A stream's socket gets a fixed send buffer (`--stream-send-buffer`);
past it and aiohttp's own 64 KiB, writes wait, the request's deltas back up to
`--max-stream-backlog` and it is aborted."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Self

import msgspec
from aiohttp import web


class SSEWriter:
    def __init__(self, response: web.StreamResponse, write_timeout: float) -> None:
        self.response = response
        self.write_timeout = write_timeout

    @classmethod
    async def open(cls, request: web.Request) -> Self:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        config = request.app["state"].config
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.stream_send_buffer)
        await resp.prepare(request)
        return cls(resp, config.stream_write_timeout)

    async def send(self, obj: Any) -> None:
        """Raises ConnectionResetError when the client has gone (or stopped reading); the
        caller's stream then aborts."""
        await self._write(b"data: " + msgspec.json.encode(obj) + b"\n\n")

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self._bounded(self.response.write_eof())

    async def _write(self, data: bytes) -> None:
        await self._bounded(self.response.write(data))

    async def _bounded(self, write: Any) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):  # no inner task whose error nobody would retrieve
                await write
        except TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {self.write_timeout:g} s") from None
