"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens, so the `anthropic`
SDK works unchanged (`anthropic.Anthropic(base_url=..., api_key=...)`; the key may come as
`x-api-key`). Requests run through the chat core (convert); errors keep the app's
middleware (metrics, Retry-After) but render in Anthropic's shape:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: ..."}}
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from radixserve.server.anthropic import cache as caching
from radixserve.server.anthropic import convert
from radixserve.server.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TokenCount,
    error_body,
)
from radixserve.server.anthropic.stream import stream_message
from radixserve.server.body import too_large
from radixserve.server.chat import core as chat_core
from radixserve.server.chat import reasoning
from radixserve.server.chat.core import Api, Call, Turn
from radixserve.server.errors import ApiError
from radixserve.server.state import Flight

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AnthropicError(ApiError):
    """An ApiError in Anthropic's shape; the app's middleware still counts and renders it."""

    @classmethod
    def of(cls, e: ApiError) -> AnthropicError:
        return cls(e.status, e.message, e.param, e.code, e.headers)

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(error_body(self.status, self.message)),
                            content_type="application/json", headers=self.headers)


def anthropic_errors(handler: Handler) -> Handler:
    """Whatever goes wrong in `handler` leaves it as an AnthropicError."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except AnthropicError:
            raise
        except ApiError as e:
            raise AnthropicError.of(e) from None
        except web.HTTPRequestEntityTooLarge:
            raise AnthropicError.of(too_large(request.app["state"].config.max_request_bytes)) from None
        except web.HTTPException as e:
            if e.status < 400:
                raise
            raise AnthropicError(e.status, f"{request.method} {request.path}: {e.reason}") from None
        except ConnectionError:  # the client left: the middleware ends the request quietly
            raise
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            raise AnthropicError(500, "internal server error", code="internal_error") from None

    return wrapped


def _json(obj: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


async def _translate(call: Call) -> Turn:
    b: MessagesRequest = call.body
    parser, fmt = call.state.config.reasoning_parser, call.state.tool_format
    plan = convert.conversation(b, parser, fmt)
    sampling, opts = convert.engine_request(b, plan)
    marks = caching.find(b, call.tenant.retention_cap)

    def cut_plan(cut: MessagesRequest) -> chat_core.Plan:  # a breakpoint's prefix, rendered as the whole is
        return chat_core.constrain(convert.conversation(cut, parser, fmt), parser)

    def wrap(render: Callable[[], list[int]]) -> Callable[[], list[int]]:
        return caching.renderer(call.state, render, marks, opts, cut_plan, convert.RENAME)

    return Turn(plan, sampling, opts, wrap=wrap, data=marks)


async def _reply(call: Call, turn: Turn, flight: Flight) -> web.StreamResponse:
    b: MessagesRequest = call.body
    state, marks = call.state, turn.data
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    if b.stream:
        return await stream_message(call.request, state, flight, turn.plan, b, mid, marks.usage)
    out = (await state.collect(flight))[0]
    content, reason, sequence = await reasoning.read_long([out], turn.plan, lambda a: convert.answer(out, a, b))
    return _json(Message(mid, "assistant", state.answered_by(b.model), content, reason, sequence, marks.usage(out)))


MESSAGES = Api(MessagesRequest, convert.RENAME, _translate, _reply)
messages = anthropic_errors(chat_core.route(MESSAGES))


@anthropic_errors
async def count_tokens(request: web.Request) -> web.StreamResponse:
    """The rendered prompt's tokens (system, messages and the offered tools), generating nothing."""
    state, _, _, b = await chat_core.begin(request, CountTokensRequest, admit=False)
    parser = state.config.reasoning_parser
    plan = chat_core.constrain(convert.conversation(b, parser, state.tool_format), parser)
    ids = await state.off_loop(chat_core.renderer(state.engine, plan, convert.RENAME))
    return _json(TokenCount(len(ids)))


ROUTES = {"/v1/messages": messages, "/v1/messages/count_tokens": count_tokens}


@anthropic_errors
async def unrouted(request: web.Request) -> web.StreamResponse:
    """Another method on a route, or a path under /v1/messages this server does not serve."""
    if request.path in ROUTES:
        raise ApiError(405, f"{request.method} {request.path}: method not allowed; use POST")
    raise ApiError(404, f"{request.method} {request.path}: not found; this server serves POST {' and POST '.join(ROUTES)}")


OPENAPI_ROUTES: list[tuple[str, str, type | None, type | None, str]] = [
    ("POST", "/v1/messages", MessagesRequest, Message,
     "Anthropic Messages API; `stream: true` answers with Anthropic's named server-sent events"),
    ("POST", "/v1/messages/count_tokens", CountTokensRequest, TokenCount,
     "Anthropic token counting: the rendered prompt's tokens, tools included"),
]


def add_routes(app: web.Application) -> None:
    """Register this module's routes on the app."""
    for path, handler in ROUTES.items():
        app.router.add_post(path, handler)
        app.router.add_route("*", path, unrouted)  # same resource: a GET is a 405 in Anthropic's shape
    app.router.add_route("*", "/v1/messages/{tail:.*}", unrouted)
