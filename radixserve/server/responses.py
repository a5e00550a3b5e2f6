"""OpenAI Responses API: POST /v1/responses (whole or streamed), and stored responses:
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request becomes a chat_core Plan (its input items as chat messages, its tools: responses_input)
and runs through the chat core: rendered by the model's chat template, admitted, then collected
or streamed. A stored response keeps its Context: a continuation (previous_response_id) renders
the whole conversation and, when that text starts with the stored one, reuses its tokens (prompt
and output, as the engine ran them) as its first tokens, so the prefix cache holds the whole
earlier turn.

With --reasoning-parser the output's `<think>` part is a leading reasoning item (counted in
usage.output_tokens_details.reasoning_tokens) and the message or calls come from the rest, as
chat splits reasoning_content (server/reasoning.py); `reasoning: {"effort": "none"}` turns
thinking off in the template, as chat's chat_template_kwargs {"enable_thinking": false}. A
stored turn keeps the output as the model wrote it, reasoning included: the template decides
what a continuation shows of it."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.request import Retention, SamplingParams
from radixserve.server import chat_core, reasoning, responses_stored, tools
from radixserve.server.chat_core import Plan, Rendered
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ToolCall
from radixserve.server.responses_input import choose, echo_text, listed_items, new_id, parse_tools, text_schema, to_messages
from radixserve.server.responses_protocol import (
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
from radixserve.server.responses_store import StoredResponse, pack_context
from radixserve.server.responses_stored import STORE, db, not_found
from radixserve.server.responses_stream import EventWriter, LiveItems, function_item
from radixserve.server.state import Flight, RequestOptions, ServerState

RENAME = {"max_new_tokens": "max_output_tokens", "prompt": "input", "input_ids": "input", "json_schema": "text.format"}


# -- create ----------------------------------------------------------------------------------
async def create(request: web.Request) -> web.StreamResponse:
    state, arrival, tenant, b = await chat_core.begin(request, CreateResponseRequest)
    plan, params = plan_of(b, state.config.reasoning_parser, state.tool_format)
    prev = await _continued(request, tenant.id, b, plan)
    rendered = Rendered()
    render = chat_core.renderer(state.engine, plan, RENAME, None if prev is None else (prev.text, prev.ids), rendered)
    opts = RequestOptions(rename=RENAME, prompt_cache_key=b.prompt_cache_key,  # a routing hint, as in chat
                          retention=Retention.named(b.prompt_cache_retention, "prompt_cache_retention"))
    async with chat_core.admit(state, tenant, plan, [render], [params], opts, arrival) as flight:
        resp = _new_response(state, b)
        if b.stream:
            return await _stream(request, tenant.id, b, plan, rendered, flight, resp)
        out = (await state.collect(flight))[0]
        chat_core.finish_reason(out)  # an engine error is a 500, as in chat
        finish(resp, out, plan, item_ids(), state.engine.tokenizer)
        await _save(request, tenant.id, b, plan, rendered, out, resp)
        return web.Response(body=msgspec.json.encode(resp), content_type="application/json")


def plan_of(b: CreateResponseRequest, reasoning_parser: str | None,
            tool_format: str = "hermes") -> tuple[Plan, SamplingParams]:
    """The request checked, as a plan and its one choice's sampling parameters; the
    instructions are the first message. Without the stored context it may continue (_continued)."""
    if b.max_output_tokens is not None and b.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens: must be at least 1, got {b.max_output_tokens}", param="max_output_tokens")
    if b.top_logprobs:
        raise ApiError(400, "top_logprobs: logprobs are not supported on /v1/responses", param="top_logprobs")
    if b.background:
        raise ApiError(400, "background: background responses are not supported", param="background")
    schema = text_schema(b.text)
    offered = parse_tools(b.tools)
    mode, callable_tools = choose(offered, b.tool_choice)
    if mode == "required" and schema is not None:
        raise ApiError(400, "text.format: cannot be combined with a required tool call", param="text.format")
    kwargs = {"enable_thinking": False} if (b.reasoning or {}).get("effort") == "none" else {}
    system = [{"role": "system", "content": b.instructions}] if b.instructions else []
    plan = Plan([*system, *to_messages(b.input)], tools.RESPONSES_PARAMS, offered, mode, callable_tools, schema,
                tool_format=tool_format, one_call=b.parallel_tool_calls is False, template_kwargs=kwargs)
    chat_core.constrain(plan, reasoning_parser)
    sampling = chat_core.Sampling(max_tokens=b.max_output_tokens, temperature=b.temperature, top_p=b.top_p)
    return plan, chat_core.sampling_params(plan, sampling)[0]


async def _continued(request: web.Request, tenant: str, b: CreateResponseRequest, plan: Plan) -> Context | None:
    """The stored context a continuation (previous_response_id) goes on from: its conversation
    goes into the plan, after the instructions."""
    rid = b.previous_response_id
    if rid is None:
        return None
    row = await db(request, request.app[STORE].get, tenant, rid)
    if row is None:
        raise not_found(rid, "previous_response_id")
    prev = row.loaded_context()
    at = _conversation_at(b)
    plan.messages[at:at] = prev.messages
    return prev


def _conversation_at(b: CreateResponseRequest) -> int:
    """Where a plan's conversation starts: after the instructions, which are this request's own
    (a stored turn keeps the conversation without them)."""
    return 1 if b.instructions else 0


def _new_response(state: ServerState, b: CreateResponseRequest) -> ResponseObject:
    return ResponseObject(
        id=new_id("resp"), created_at=int(time.time()), model=state.model_name, status="in_progress", output=[],
        instructions=b.instructions, tools=b.tools or [], tool_choice=b.tool_choice or "auto", text=echo_text(b.text),
        temperature=1.0 if b.temperature is None else b.temperature, top_p=1.0 if b.top_p is None else b.top_p,
        max_output_tokens=b.max_output_tokens, previous_response_id=b.previous_response_id, metadata=b.metadata or {},
        parallel_tool_calls=b.parallel_tool_calls is not False, store=b.store, user=b.user,
        truncation=b.truncation or "disabled")


def item_ids() -> tuple[str, str]:
    """The ids of a response's reasoning item and message, known before its text is."""
    return new_id("rs"), new_id("msg")


def finish(resp: ResponseObject, out: Output, plan: Plan, ids: tuple[str, str], tok: Any,
           streamed: list[ToolCall] | None = None) -> None:
    """Fill in the output items, the status and the usage of a finished request."""
    a = chat_core.answer(out, plan, streamed)
    resp.output = _output_items(out, a, ids)
    resp.status = "completed" if out.finish_reason == "stop" else "incomplete"
    if resp.status == "incomplete":
        resp.incomplete_details = IncompleteDetails("max_output_tokens" if out.finish_reason == "length" else None)
    thought = 0 if a.reasoning is None else min(reasoning.reasoning_tokens(tok, out.token_ids), out.completion_tokens)
    resp.usage = ResponseUsage(out.prompt_tokens, InputTokensDetails(out.cached_tokens), out.completion_tokens,
                               OutputTokensDetails(thought), out.prompt_tokens + out.completion_tokens)


def _output_items(out: Output, a: reasoning.Answer, ids: tuple[str, str]) -> list[OutputItem]:
    """The reasoning (when split off), then a message, function calls, or both: the content
    parsed as the chat path parses it. A response cut off while reasoning has no message."""
    status = "incomplete" if out.finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    if a.reasoning is not None:
        items.append(ReasoningOutput(ids[0], [ReasoningText(a.reasoning)], status if a.content is None else "completed"))
    if a.content or not (a.calls or a.reasoning is not None):
        items.append(OutputMessage(ids[1], [OutputText(a.content or "")], status))
    return items + [function_item(c) for c in a.calls]


async def _stream(request: web.Request, tenant: str, b: CreateResponseRequest, plan: Plan, rendered: Rendered,
                  flight: Flight, resp: ResponseObject) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    w = await EventWriter.open(request)
    await w.start(resp)
    ids = item_ids()
    live = LiveItems(w, plan.parser, ids, plan.mode != "required",
                     tools.call_stream(plan.mode, plan.offered, plan.tool_format, plan.one_call))
    out: Output | None = None
    async with aclosing(state.run(flight.reqs[0], flight.tickets[0], flight.arrival)) as deltas:
        async for d in deltas:
            await live.feed(d.text, d.finished)
            out = d.output if d.finished else out
    if out is None or out.finish_reason == "error":
        await w.fail(resp, "server_error", f"internal error while generating: {out.error if out else 'no output'}")
        return w.response
    finish(resp, out, plan, ids, state.engine.tokenizer, live.streamed_calls())
    try:
        await _save(request, tenant, b, plan, rendered, out, resp)
    except ApiError as e:
        await w.fail(resp, "server_error", e.message)
        return w.response
    resp.output = await live.finish(resp.output)
    await w.finish(resp)
    return w.response


# -- storing ---------------------------------------------------------------------------------
async def _save(request: web.Request, tenant: str, b: CreateResponseRequest, plan: Plan, rendered: Rendered, out: Output,
                resp: ResponseObject) -> None:
    if not b.store:
        return
    tok = request.app["state"].engine.tokenizer

    def row() -> StoredResponse:
        ctx = _context_after(tok, plan.messages[_conversation_at(b):], rendered, out)
        return StoredResponse(resp.id, tenant, resp.created_at, msgspec.json.encode(resp),
                              msgspec.json.encode(listed_items(b.input)), pack_context(ctx))

    store = request.app[STORE]
    await db(request, lambda: store.put(row()))


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
    app.router.add_post("/v1/responses", create)
    responses_stored.add_routes(app)
