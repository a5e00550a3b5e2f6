"""OpenAI-compatible API: /v1/chat/completions and /v1/models, and what /v1/completions shares with them."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.limits import MAX_N
from radixserve.request import Retention, SamplingParams, TokenLogprob
from radixserve.server.auth import Tenant
from radixserve.server.chat import core as chat_core
from radixserve.server.chat import reasoning, tools
from radixserve.server.chat.core import Api, Call, Plan, Turn
from radixserve.server.errors import ApiError
from radixserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    _OpenAISampling,
)
from radixserve.server.sse import SSEWriter
from radixserve.server.state import Flight, RequestOptions, ServerState

MAX_TOP_LOGPROBS = 20
RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs",
          "prompt": "messages", "json_schema": "response_format"}


def check_common(b: _OpenAISampling) -> None:
    if b.max_tokens is not None and b.max_tokens < 1:
        raise ApiError(400, f"max_tokens: must be at least 1, got {b.max_tokens}", param="max_tokens")
    if not 1 <= b.n <= MAX_N:
        raise ApiError(400, f"n: {b.n} is out of range [1, {MAX_N}]", param="n")
    if b.stream_options is not None and not b.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")


def sampling(b: _OpenAISampling, max_tokens: int | None, top: int, logprobs: bool) -> chat_core.Sampling:
    return chat_core.Sampling(
        n=b.n, max_tokens=max_tokens, min_tokens=b.min_tokens, temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
        min_p=b.min_p, frequency_penalty=b.frequency_penalty, presence_penalty=b.presence_penalty,
        repetition_penalty=b.repetition_penalty, stop=b.stop, stop_token_ids=b.stop_token_ids, ignore_eos=b.ignore_eos,
        skip_special_tokens=b.skip_special_tokens, seed=b.seed, logprobs=logprobs, top_logprobs=top, regex=b.regex,
        ebnf=b.ebnf, grammar_after=b.grammar_after, logit_bias=b.logit_bias)


def sampling_params(b: _OpenAISampling, max_tokens: int | None, i: int, top: int, logprobs: bool) -> SamplingParams:
    """Choice i of a completion: no plan, so no constraint but the client's own."""
    return sampling(b, max_tokens, top, logprobs).params(i)


def _response_format(fmt: dict[str, Any] | None) -> tuple[str, bool] | None:
    """OpenAI's response_format as (JSON schema text, strict), or None for free text."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return json.dumps({"type": "object"}), False
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ApiError(400, "response_format.json_schema: expected {\"name\": ..., \"schema\": {...}}",
                           param="response_format.json_schema")
        return json.dumps(spec.get("schema", {})), spec.get("strict") is True
    raise ApiError(400, f"response_format.type: {fmt.get('type')!r} is not one of text, json_object, json_schema, "
                   "structural_tag", param="response_format.type")


def request_options(b: _OpenAISampling) -> RequestOptions:
    return RequestOptions(b.rid, b.priority, b.cache_salt, b.public_prefix_len, rename=RENAME,
                          prompt_cache_key=b.prompt_cache_key,
                          retention=Retention.named(b.prompt_cache_retention, "prompt_cache_retention"))


def usage(outs: list[Output], prompts: int = 1) -> Usage:
    """Each prompt counts once, however many choices share it (they share its KV too)."""
    firsts = outs[:: max(len(outs) // prompts, 1)]
    p = sum(o.prompt_tokens for o in firsts)
    c = sum(o.completion_tokens for o in outs)
    return Usage(p, c, p + c, PromptTokensDetails(sum(o.cached_tokens for o in firsts)))


# -- chat ------------------------------------------------------------------------------------
def _messages(b: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not b.messages:
        raise ApiError(400, "messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(b.messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role: {m.role!r} is not one of system, user, assistant, tool",
                           param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                                   param=f"messages[{i}].content[{j}].type")
            content = "".join(p.text or "" for p in content)
        if m.role == "assistant" and m.tool_calls:
            content = "\n".join(x for x in (content, tools.history_text(m.tool_calls, f"messages[{i}].tool_calls")) if x)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def _pair(text_bytes: tuple[str, list[int]], logprob: float) -> tuple[str, float, list[int]]:
    return text_bytes[0], logprob, text_bytes[1]


def _chat_logprobs(state: ServerState, lps: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if lps is None:
        return None

    def tok(t: int) -> tuple[str, list[int]]:
        s = state.token_text(t)
        return s, list(s.encode())

    content = []
    for lp in lps:
        s, by = tok(lp.token_id)
        top = [TopLogprob(*_pair(tok(t), v)) for v, t in lp.top]
        content.append(TokenLogprobOut(s, lp.logprob if lp.logprob is not None else 0.0, by, top))
    return ChoiceLogprobs(content)


async def begin(request: web.Request, typ: type) -> tuple[ServerState, float, Tenant, Any]:
    """chat_core.begin, then the checks of the fields chat and completions share."""
    state, arrival, tenant, b = await chat_core.begin(request, typ)
    check_common(b)
    return state, arrival, tenant, b


# Arguments of apply_chat_template itself: chat_template_kwargs may not set them.
_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs"})


def _check_template_kwargs(kw: dict[str, Any] | None) -> None:
    for k in kw or {}:
        if k in _TEMPLATE_ARGS or not k.isidentifier():
            why = "is an argument of the template call itself" if k in _TEMPLATE_ARGS else "is not a variable name"
            raise ApiError(400, f"chat_template_kwargs.{k}: {why}", param=f"chat_template_kwargs.{k}")


def chat_plan(b: ChatCompletionRequest, tool_format: str = "hermes") -> Plan:
    """The request's plan, before the core's constraint (chat_core.prepare)."""
    tag = None
    if b.response_format is not None and b.response_format.get("type") == "structural_tag":
        tag = json.dumps({k: v for k, v in b.response_format.items() if k != "type"})
        b.response_format = None
    schema = _response_format(b.response_format)
    offered = tools.parse_tools(b.tools)
    mode, callable_tools = tools.choose(offered, b.tool_choice)
    if mode == "required" and (schema is not None or tag is not None):
        raise ApiError(400, "response_format: cannot be combined with a required tool call", param="response_format")
    _check_template_kwargs(b.chat_template_kwargs)
    return Plan(_messages(b), tools.CHAT_PARAMS, offered, mode, callable_tools, schema, tag, tool_format=tool_format,
                one_call=b.parallel_tool_calls is False, template_kwargs=b.chat_template_kwargs or {})


def chat_sampling(b: ChatCompletionRequest) -> chat_core.Sampling:
    if b.top_logprobs is not None and not b.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    top = b.top_logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs: {top} is out of range [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    return sampling(b, max_tokens, top, b.logprobs)


async def _translate(call: Call) -> Turn:
    b: ChatCompletionRequest = call.body
    check_common(b)
    plan = chat_plan(b, call.state.tool_format)
    opts = request_options(b)
    if b.max_completion_tokens is not None:  # errors name the field the client sent
        opts.rename = {**opts.rename, "max_new_tokens": "max_completion_tokens"}
    return Turn(plan, chat_sampling(b), opts)


async def _reply(call: Call, turn: Turn, flight: Flight) -> web.StreamResponse:
    b: ChatCompletionRequest = call.body
    if not b.stream or turn.plan.mode == "required":  # a required call: parsed whole, at the end
        return await _chat_whole(call.request, call.state, b, flight, turn.plan)
    return await _chat_stream(call.request, call.state, b, flight, turn.plan)


CHAT = Api(ChatCompletionRequest, RENAME, _translate, _reply)
chat_completions = chat_core.route(CHAT)


async def _chat_whole(request: web.Request, state: ServerState, b: ChatCompletionRequest, flight: Flight,
                      plan: Plan) -> web.StreamResponse:
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    outs = await state.collect(flight)
    choices = await reasoning.read_long(outs, plan, lambda *answers: [chat_choice(state, i, o, a) for i, (o, a)
                                                                      in enumerate(zip(outs, answers))])
    if not b.stream:
        resp = ChatCompletionResponse(cid, created, state.answered_by(b.model), choices, usage(outs))
        return web.Response(body=msgspec.json.encode(resp), content_type="application/json")
    return await _stream_whole(request, cid, created, state.answered_by(b.model), choices, usage(outs) if include_usage(b) else None)


class _LiveChoice(reasoning.LiveParts):
    """One choice of a chat stream: what one engine delta adds, gathered into one chunk's delta
    (reasoning, content, and with tools each call as it completes: reasoning.LiveParts)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan.parser, True, tools.call_stream(plan.mode, plan.offered, plan.tool_format, plan.one_call),
                         plan.offered)
        self.plan = plan
        self.delta = ChatDelta()
        self.n_calls = 0

    async def reasoning_delta(self, text: str) -> None:
        self.delta.reasoning_content = (self.delta.reasoning_content or "") + text

    async def content_delta(self, index: int, text: str) -> None:
        if text:
            self.delta.content = (self.delta.content or "") + text

    async def tool_call(self, index: int, call: ToolCall) -> None:
        self.delta.tool_calls = [*(self.delta.tool_calls or []), ToolCallDelta(self.n_calls, call.id, call.function)]
        self.n_calls += 1

    async def finish(self, out: Output) -> str:
        """The rest of the answer once it is whole (held text that is content, calls only the
        whole answer shows) into the delta; returns the finish reason."""
        a = await reasoning.read_answer(out, self.plan, self.streamed_calls())
        await self.content_delta(0, self.rest(a.content or ""))
        sent = {c.id for c in self.streamed_calls()}
        for call in a.calls:
            if call.id not in sent:
                await self.tool_call(0, call)
        return finish_reason(out, a)

    def take(self) -> ChatDelta | None:
        d, self.delta = self.delta, ChatDelta()
        return d if d.content or d.reasoning_content or d.tool_calls else None


async def _chat_stream(request: web.Request, state: ServerState, b: ChatCompletionRequest, flight: Flight,
                       plan: Plan) -> web.StreamResponse:
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    sse = await SSEWriter.open(request)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(cid, created, state.answered_by(b.model), choices, usage)

    for i in range(b.n):
        await sse.send(chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))]))
    outs: list[Output | None] = [None] * b.n
    live = [_LiveChoice(plan) for _ in range(b.n)]
    async for i, d in state.merged(flight):
        lps = _chat_logprobs(state, d.logprobs) if b.logprobs and d.logprobs else None
        reason = None
        if d.finished and d.output is not None:
            outs[i] = d.output
            if (err := reasoning.ended_early(d.output)) is not None:  # an error event, never a finish reason
                await sse.send(err.body())
                continue
        await live[i].feed(d.text, d.finished)
        if d.finished and d.output is not None:
            reason = await live[i].finish(d.output)
        delta = live[i].take()
        if delta is not None or lps or reason:
            await sse.send(chunk([ChatChunkChoice(i, delta or ChatDelta(), reason, lps)]))
    if include_usage(b):
        await sse.send(chunk([], usage([o for o in outs if o is not None])))
    await sse.done()
    return sse.response


def include_usage(b: _OpenAISampling) -> bool:
    return b.stream_options is not None and b.stream_options.include_usage


def finish_reason(o: Output, a: reasoning.Answer) -> str:
    """A finished output's finish reason: "tool_calls" when it stopped after calls."""
    return "tool_calls" if a.calls and o.finish_reason == "stop" else o.finish_reason


def chat_choice(state: ServerState, i: int, o: Output, a: reasoning.Answer) -> ChatChoice:
    """Choice i, read as `a` (reasoning.read_long: tool calls and JSON are read from the content
    only, never from the reasoning)."""
    message = AssistantMessage(content=a.content, tool_calls=a.calls or None, reasoning_content=a.reasoning)
    return ChatChoice(i, message, finish_reason(o, a), _chat_logprobs(state, o.logprobs))


async def _stream_whole(request: web.Request, cid: str, created: int, model: str, choices: list[ChatChoice],
                        usage: Usage | None) -> web.StreamResponse:
    sse = await SSEWriter.open(request)
    for c in choices:
        calls = [ToolCallDelta(k, t.id, t.function) for k, t in enumerate(c.message.tool_calls or [])] or None
        delta = ChatDelta(role="assistant", content=c.message.content, tool_calls=calls,
                          reasoning_content=c.message.reasoning_content)
        await sse.send(ChatCompletionChunk(cid, created, model, [ChatChunkChoice(c.index, delta, c.finish_reason, c.logprobs)]))
    if usage is not None:
        await sse.send(ChatCompletionChunk(cid, created, model, [], usage))
    await sse.done()
    return sse.response


# -- completions -----------------------------------------------------------------------------
def _cards(state: ServerState) -> list[ModelCard]:
    """The base model, then each LoRA adapter with the base as its parent (as vLLM lists them)."""
    n = state.engine.context_len
    return [ModelCard(state.model_name, state.created, max_model_len=n),
            *(ModelCard(name, state.created, max_model_len=n, root=a.get("path"), parent=state.model_name)
              for name, a in state.loras.items())]


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    state.auth.of_request(request)
    return web.Response(body=msgspec.json.encode(ModelList(_cards(state))), content_type="application/json")


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the openai client's `models.retrieve`."""
    state: ServerState = request.app["state"]
    state.auth.of_request(request)
    name = request.match_info["model"]
    state.adapter_of(name)  # 404 unless served
    card = next(c for c in _cards(state) if c.id == name)
    return web.Response(body=msgspec.json.encode(card), content_type="application/json")
