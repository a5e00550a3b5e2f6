"""A client that vanishes at any moment leaks nothing: for every route, the handler is cut at
its 1st, 2nd, ... k-th await (the connection closed and the exception aiohttp raises on a
disconnect thrown in where it waits) until a run completes uncut. After every cut: no
admission ticket held, no rid stuck, no KV in use, the pool's integrity intact."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.auth import Auth
from radixserve.server.state import ServerState

IDS = [5, 6, 7, 8, 9, 10, 11, 12]
SP = {"max_new_tokens": 3, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Agents call tools."}], "max_tokens": 3, "ignore_eos": True}
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"type": "integer",
          "minimum": 0, "maximum": 9}}, "required": ["a"]}}}
CASES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/generate", {"input_ids": IDS, "sampling_params": SP, "rid": "probe"}),
    ("POST", "/generate", {"input_ids": IDS, "sampling_params": SP, "stream": True, "rid": "probe"}),
    ("POST", "/generate", {"input_ids": [IDS, IDS[:4]], "sampling_params": SP}),
    ("POST", "/v1/chat/completions", {**CHAT, "rid": "probe"}),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True, "n": 2, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True, "tools": [TOOL], "tool_choice": "required", "max_tokens": 12}),
    ("POST", "/v1/chat/completions", {**CHAT, "response_format": SCHEMA, "max_tokens": 12}),
    ("POST", "/v1/completions", {"prompt": IDS, "max_tokens": 3, "ignore_eos": True, "n": 2}),
    ("POST", "/v1/completions", {"prompt": "Agents", "max_tokens": 3, "ignore_eos": True, "stream": True}),
    ("POST", "/v1/responses", {"input": "Agents call tools.", "max_output_tokens": 3, "store": False}),
    ("POST", "/v1/responses", {"input": "Agents call tools.", "max_output_tokens": 3, "stream": True, "store": False}),
    ("POST", "/v1/responses", {"input": "Agents call tools.", "max_output_tokens": 12, "store": False, "tool_choice": "required",
                               "tools": [{"type": "function", "name": "add", "parameters": TOOL["function"]["parameters"]}]}),
    ("POST", "/v1/messages", {"max_tokens": 3, "messages": CHAT["messages"]}),
    ("POST", "/v1/messages", {"max_tokens": 3, "messages": CHAT["messages"], "stream": True}),
    ("POST", "/v1/messages", {"max_tokens": 12, "messages": CHAT["messages"], "tool_choice": {"type": "any"},
                              "tools": [{"name": "add", "input_schema": TOOL["function"]["parameters"]}]}),
    ("POST", "/v1/messages/count_tokens", {"messages": CHAT["messages"]}),
    ("POST", "/abort_request", {"rid": "nothing"}),
    ("GET", "/server_info?check_integrity=1", None),
    ("GET", "/metrics", None),
    ("POST", "/flush_cache", None),
]


class _Cut:
    """Drive a handler coroutine; at its k-th suspension close the client's connection and
    throw `exc` in where it waits, as aiohttp does when a client disconnects."""

    def __init__(self, coro: Any, k: int, request: web.Request, exc: Callable[[], BaseException]) -> None:
        self.coro, self.k, self.request, self.exc = coro, k, request, exc
        self.fired = False

    def __await__(self) -> Any:
        n, value, error = 0, None, None
        while True:
            try:
                awaited = self.coro.throw(error) if error is not None else self.coro.send(value)
            except StopIteration as stop:
                return stop.value
            n += 1
            if n == self.k:
                self.fired = True
                if isinstance(awaited, asyncio.Future):  # what Task.cancel() does to the future it waits on
                    awaited.cancel()
                    awaited.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody else will look
                if self.request.transport is not None:
                    self.request.transport.close()
                value, error = None, self.exc()
                continue
            try:
                value, error = (yield awaited), None
            except BaseException as e:  # cancellation from outside goes on into the handler
                value, error = None, e


async def _settled(state: ServerState) -> None:
    """Wait (bounded) until nothing holds a ticket, a rid or KV; then check the pool."""
    engine, adm = state.engine, state.admission
    for _ in range(1000):
        s = await asyncio.to_thread(engine.stats)
        clean = adm.queued == adm.in_flight == 0 and not state.active and s.running == s.waiting == s.kv_in_use_slots == 0
        if clean:
            break
        await asyncio.sleep(0.02)
    assert clean, (adm.queued, adm.in_flight, dict(adm.by_tenant), list(state.active), s)
    assert not any(adm.by_tenant.values()) and not any(adm.in_flight_by_tenant.values())
    await asyncio.to_thread(engine.check_integrity)


async def _cut_every_await(engine: Any, method: str, path: str, body: dict | None, exc: Callable[[], BaseException]) -> int:
    state = ServerState(engine, ServerConfig(), Auth(), "tiny")
    await state.build_token_table()
    cuts: list[_Cut] = []

    @web.middleware
    async def cut(request: web.Request, handler: Any) -> web.StreamResponse:
        c = _Cut(handler(request), len(cuts) + 1, request, exc)
        cuts.append(c)
        return await c

    app = build_app(state)
    app.middlewares.append(cut)
    server = TestServer(app)
    await server.start_server()  # TestServer runs with handler_cancellation=True, as `radixserve serve` does
    try:
        async with aiohttp.ClientSession() as session:
            while not cuts or cuts[-1].fired:
                assert len(cuts) < 300, "the handler never completed uncut"
                try:
                    async with session.request(method, server.make_url(path), json=body) as r:
                        await r.read()
                        status = r.status
                except (TimeoutError, aiohttp.ClientError):
                    status = None
                await _settled(state)
            assert status is not None and status < 500, (path, status)  # the uncut run still works
    finally:
        await server.close()
        state.executor.shutdown(wait=False)
    return len(cuts)


@pytest.mark.parametrize("exc", [asyncio.CancelledError, ConnectionResetError], ids=["cancelled", "reset"])
def test_a_client_gone_at_any_await_of_any_route_leaves_no_ticket_rid_or_kv(tiny_engine, exc):
    awaits = [asyncio.run(_cut_every_await(tiny_engine, method, path, body, exc)) for method, path, body in CASES]
    assert min(awaits) >= 1 and sum(awaits) >= 2 * len(CASES), awaits  # the cuts really went through the handlers
