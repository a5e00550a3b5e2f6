"""Server-sent events: `data: <json>` per chunk, `data: [DONE]` at the end."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web


class SSEWriter:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SSEWriter:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return cls(resp)

    async def send(self, obj: Any) -> None:
        """Raises ConnectionResetError when the client has gone; the caller's stream then aborts."""
        await self.response.write(b"data: " + msgspec.json.encode(obj) + b"\n\n")

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
