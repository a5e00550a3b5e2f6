"""OpenAI Responses API: POST /v1/responses (whole or streamed), and stored responses:
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request runs through the chat core (chat_core.serve): translated into a Turn by
translate (its input items as chat messages, its tools), rendered by the model's chat
template and admitted there, then collected or streamed here (`reply`). A stored response
keeps its Context: a continuation (previous_response_id) renders the whole conversation and,
when that text starts with the stored one, reuses its tokens (prompt and output, as the engine
ran them) as its first tokens, so the prefix cache holds the whole earlier turn.

With --reasoning-parser the output's `<think>` part is a leading reasoning item (counted in
usage.output_tokens_details.reasoning_tokens) and the message or calls come from the rest, as
chat splits reasoning_content (server/chat/reasoning.py); `reasoning: {"effort": "none"}` turns
thinking off in the template, as chat's chat_template_kwargs {"enable_thinking": false}. A
stored turn keeps the output as the model wrote it, reasoning included: the template decides
what a continuation shows of it."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.server.chat import core as chat_core
from radixserve.server.chat import reasoning, tools
from radixserve.server.chat.core import Api, Call, Rendered, Turn
from radixserve.server.errors import ApiError
from radixserve.server.responses import stored
from radixserve.server.responses.protocol import (
    Context,
    CreateResponseRequest,
    DeletedResponse,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from radixserve.server.responses.store import StoredResponse, pack_context
from radixserve.server.responses.stored import STORE, db
from radixserve.server.responses.stream import EventWriter, LiveItems, function_item
from radixserve.server.responses.translate import RENAME, Pending, translate
from radixserve.server.state import Flight


# -- create ----------------------------------------------------------------------------------
async def reply(call: Call, turn: Turn, flight: Flight) -> web.StreamResponse:
    """The response, whole or as typed events (translate.translate began it)."""
    b: CreateResponseRequest = call.body
    if b.stream:
        return await _stream(call, turn, flight)
    out = (await call.state.collect(flight))[0]
    pending: Pending = turn.data
    a = await reasoning.read_answer(out, turn.plan, tok=call.state.engine.tokenizer)  # an engine error is a 500, as in chat
    finish(pending.resp, out, a, pending.ids)
    await _save(call, turn, out)
    return web.Response(body=msgspec.json.encode(pending.resp), content_type="application/json")


RESPONSES = Api(CreateResponseRequest, RENAME, translate, reply)


def finish(resp: ResponseObject, out: Output, a: reasoning.Answer, ids: tuple[str, str]) -> None:
    """Fill in the output items, the status and the usage of a finished request read as `a`
    (reasoning.read_answer, its reasoning tokens counted)."""
    resp.output = _output_items(out, a, ids)
    resp.status = "completed" if out.finish_reason == "stop" else "incomplete"
    if resp.status == "incomplete":
        resp.incomplete_details = IncompleteDetails("max_output_tokens" if out.finish_reason == "length" else None)
    resp.usage = ResponseUsage(out.prompt_tokens, InputTokensDetails(out.cached_tokens), out.completion_tokens,
                               OutputTokensDetails(a.thought), out.prompt_tokens + out.completion_tokens)


def _output_items(out: Output, a: reasoning.Answer, ids: tuple[str, str]) -> list[OutputItem]:
    """The reasoning (when split off), then a message, function calls, or both: the content
    parsed as the chat path parses it. A response cut off while reasoning has no message."""
    status = "incomplete" if out.finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    if a.reasoning is not None:
        items.append(ReasoningOutput(ids[0], [ReasoningText(a.reasoning)], status if a.content is None else "completed"))
    if a.content or not (a.calls or a.reasoning is not None):
        items.append(OutputMessage(ids[1], [OutputText(a.content or "")], status))
    cut = len(a.calls) - 1 if a.cut else -1  # the call max_tokens cut short: incomplete, as the message is
    return items + [function_item(c, "incomplete" if k == cut else "completed") for k, c in enumerate(a.calls)]


async def _stream(call: Call, turn: Turn, flight: Flight) -> web.StreamResponse:
    state, plan, pending = call.state, turn.plan, turn.data
    resp = pending.resp
    w = await EventWriter.open(call.request)
    await w.start(resp)
    live = LiveItems(w, plan.parser, pending.ids, plan.mode != "required",
                     tools.call_stream(plan.mode, plan.offered, plan.tool_format, plan.one_call), plan.offered)
    out: Output | None = None
    async with aclosing(state.run(flight.reqs[0], flight.tickets[0], flight.arrival)) as deltas:
        async for d in deltas:
            await live.feed(d.text, d.finished)
            out = d.output if d.finished else out
    if out is None:
        await w.fail(resp, "server_error", "internal error while generating: no output")
        return w.response
    if (err := reasoning.ended_early(out)) is not None:  # failed: never a cut answer as a whole one
        await w.fail(resp, "server_error", err.message)
        return w.response
    finish(resp, out, await reasoning.read_answer(out, plan, live.streamed_calls(), state.engine.tokenizer), pending.ids)
    try:
        await _save(call, turn, out)
    except ApiError as e:
        await w.fail(resp, "server_error", e.message)
        return w.response
    resp.output = await live.finish(resp.output)
    await w.finish(resp)
    return w.response


# -- storing ---------------------------------------------------------------------------------
async def _save(call: Call, turn: Turn, out: Output) -> None:
    pending: Pending = turn.data
    items, rendered = pending.items, turn.rendered
    if items is None or rendered is None:  # store: false
        return
    tok, resp = call.state.engine.tokenizer, pending.resp

    def row() -> StoredResponse:
        ctx = _context_after(tok, pending.conversation, rendered, out)
        return StoredResponse(resp.id, call.tenant.owner, resp.created_at, msgspec.json.encode(resp), items,
                              pack_context(ctx))

    store = call.request.app[STORE]
    await db(call.request, lambda: store.put(row()))


def _context_after(tok: Any, messages: list[dict[str, Any]], rendered: Rendered, out: Output) -> Context:
    """The conversation once the output is in: the output as the model wrote it (special tokens
    included, the one it stopped on left to the template) as the assistant's message.

    NOTE: decoded here, not taken from `out.text`: the engine's text skips special tokens
    (unless tool-call markers are kept), leaves out the token it stopped on, and is decoded
    after the prompt's last tokens (a word-initial space may differ)."""
    ids = out.token_ids

    def text(t: list[int]) -> str:
        return tok.decode(t, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    ends_special = bool(ids) and ids[-1] in set(getattr(tok, "all_special_ids", ()))
    said = {"role": "assistant", "content": text(ids[:-1] if ends_special else ids)}
    return Context([*messages, said], rendered.text + text(ids), [*rendered.ids, *ids])


# -- routes ----------------------------------------------------------------------------------
OPENAPI_ROUTES: list[tuple[str, str, type | None, type | None, str]] = [
    ("POST", "/v1/responses", CreateResponseRequest, ResponseObject,
     "OpenAI Responses: create a response; `stream: true` answers with typed server-sent events"),
    ("GET", "/v1/responses/{response_id}", None, ResponseObject, "A stored response (the caller's own)"),
    ("DELETE", "/v1/responses/{response_id}", None, DeletedResponse, "Delete a stored response"),
    ("GET", "/v1/responses/{response_id}/input_items", None, InputItemList,
     "A stored response's input items, a page at a time (limit, order, after)"),
]


def add_routes(app: web.Application) -> None:
    """Register this module's routes on the app."""
    app.router.add_post("/v1/responses", chat_core.route(RESPONSES))
    stored.add_routes(app)
