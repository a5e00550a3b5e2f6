"""The access log: one line per HTTP request on the "radixserve.access" logger, at INFO, e.g.

    POST /v1/chat/completions status=200 tenant=acme prompt_tokens=12 completion_tokens=8 latency_ms=153.2

A field not known for a request (no tenant before authentication, no tokens for a request
refused before admission) reads "-". Status 499: the client left before the reply ended. The
path is the raw (percent-encoded) path without its query. With --log-requests the line ends
with `prompt=` and the prompt text as a JSON string (a JSON list when one call ran several
different prompts): the prompt as the model saw it, chat template included. Never the API key.

What a request used is noted by the code that learns it (authentication: the tenant;
admission: the prompt tokens; the end of each engine run: its completion tokens) into the
`Entry` this module's middleware puts in a context variable (CURRENT) for the request's task;
the tasks a route starts to run several requests copy the context, and so share the entry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixserve.request import Req, distinct_prompts

log = logging.getLogger("radixserve.access")
CLIENT_GONE = 499  # nginx's "client closed request"


@dataclass
class Entry:
    """What one HTTP request used, as far as it is known."""

    tenant: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompts: list[str] | None = None  # only with --log-requests

    def line(self, method: str, path: str, status: int, latency_ms: float) -> str:
        parts = [method, path, f"status={status}", f"tenant={_value(self.tenant)}",
                 f"prompt_tokens={_value(self.prompt_tokens)}", f"completion_tokens={_value(self.completion_tokens)}",
                 f"latency_ms={latency_ms:.1f}"]
        if self.prompts is not None:
            text: str | list[str] = self.prompts[0] if len(self.prompts) == 1 else self.prompts
            parts.append("prompt=" + json.dumps(text))  # ASCII-escaped: a prompt never breaks the line
        return " ".join(parts)


CURRENT: ContextVar[Entry | None] = ContextVar("radixserve_access_entry", default=None)  # the request's entry


def prompt_texts(tokenizer: Any, reqs: Sequence[Req]) -> list[str]:
    """Each distinct prompt's text (run off the event loop: decoding a long prompt is real work)."""
    return [tokenizer.decode(r.token_ids[: r.prompt_len]) for r in distinct_prompts(reqs)]


@web.middleware
async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Outermost: it sees the status the errors middleware made of any exception."""
    entry = Entry()
    token = CURRENT.set(entry)
    start = time.monotonic()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:  # what the errors middleware lets through (redirects)
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        status = CLIENT_GONE
        raise
    finally:
        CURRENT.reset(token)
        if log.isEnabledFor(logging.INFO):
            log.info(entry.line(request.method, request.rel_url.raw_path, status, (time.monotonic() - start) * 1e3))


def _value(v: object) -> str:
    """A field's value on the line: "-" when unknown; a string with spaces or quotes JSON-quoted."""
    if v is None:
        return "-"
    s = str(v)
    return json.dumps(s) if not s or any(c.isspace() or c in '"=\\' or not c.isprintable() for c in s) else s
