"""One chat core under the three chat APIs (chat completions, Responses, Messages). Each API
module translates its wire types into a Turn (a Plan, a Sampling, the engine options) and reads
the engine's outputs back into its own (an Api: its body type, `translate` and `reply`);
everything between lives here once, in `serve`, which walks each stage once, in order:

    authenticate (auth; an overloaded server refuses here, before the body is read)
      -> decode (body; the model checked) -> plan (the API's translate, then prepare: the tool
      constraint, the reasoning split, the sampling parameters) -> admit (the renderer: chat
      template + prefill, off the loop; state.admit) -> submit and stream out (the API's reply)

Errors name the API's own fields: the renderer and admission rename the engine's field names
(value_error with the API's rename map), and a tool call schema's compile error names the tool
whose parameters hold the problem (tools.blame, at the place the API keeps them)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

from aiohttp import web

from radixserve.engine.protocol import EngineClient
from radixserve.request import SamplingParams
from radixserve.server.auth import TENANT_KEY, Tenant
from radixserve.server.body import read_body
from radixserve.server.chat import reasoning, tools
from radixserve.server.errors import ApiError, value_error
from radixserve.server.state import Flight, RequestOptions, ServerState


@dataclass
class Plan:
    """A chat request beyond sampling: the conversation, the tools and how a call is chosen,
    how the output is constrained, and how it is read back (reasoning split, call format)."""

    messages: list[dict[str, Any]]  # {"role", "content"}, roles as chat templates know them
    tool_schemas: str  # where this API keeps a tool's parameter schema (tools.CHAT_PARAMS ...): errors name it
    offered: list[tools.Tool] = field(default_factory=list)  # described to the model
    mode: str = "none"  # none | auto | required (tools.choose)
    callable: list[tools.Tool] = field(default_factory=list)  # what a required call may use
    schema: tuple[str, bool] | None = None  # (JSON schema text, strict)
    tag: str | None = None  # a structural tag (JSON text)
    call_tag: bool = False  # tool_choice auto, its calls constrained by `tag` (tools.auto_tag)
    parser: str | None = None  # the reasoning parser, when the output is split
    tool_format: str = "hermes"  # how the model writes tool calls (server.chat.tool_parsers)
    one_call: bool = False  # parallel calls off: the first call only
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more variables for the chat template
    prefill: str = ""  # the start of the answer (Anthropic's final assistant turn), which the model continues
    keep_markers: bool = False  # calls marked with special tokens: decoded with them (tools.keeps_markers)
    call_field: tuple[str, str] | None = None  # a constrained call's engine field and the API param it names


def constrain(plan: Plan, reasoning_parser: str | None, free: bool = True) -> Plan:
    """The tool part of a plan, once for every API: a required call is constrained to its
    schema; in auto mode, where nothing else constrains the output (`free`: no regex or EBNF
    either), the calls are constrained by a structural tag where the format has one; mode none
    offers no tools; the output is split by the reasoning parser unless the template turns
    thinking off. A required call replaces a schema of the API's: refusing the two together is
    the API's, in its own field's name."""
    harmony = plan.tool_format == "harmony"
    if plan.mode == "required" and harmony:  # its call is a message on a channel, not bare JSON
        plan.tag, plan.call_tag = tools.harmony_tag(plan.callable, required=True), True
    elif plan.mode == "required":
        plan.schema = tools.call_spec(plan.callable)
    elif plan.mode == "auto" and free and plan.schema is None and plan.tag is None:
        plan.tag = tools.auto_tag(plan.offered, plan.tool_format, plan.one_call)
        plan.call_tag = plan.tag is not None
    plan.keep_markers = tools.keeps_markers(plan.mode, plan.tool_format)
    field = tools.schema_field(plan.mode, plan.call_tag)
    if field is not None:
        plan.call_field = (field, tools.error_param(plan.offered, plan.callable, plan.tool_schemas))
    if plan.mode == "none":
        plan.offered = []
    plan.parser = "harmony" if harmony else reasoning.active(reasoning_parser, plan.template_kwargs)
    return plan


@dataclass
class Sampling:
    """The sampling knobs, in no API's names. None: the engine's default."""

    n: int = 1  # choices
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None  # choice i samples with seed + i
    logprobs: bool = False
    top_logprobs: int = 0
    regex: str | None = None
    ebnf: str | None = None
    grammar_after: str | None = None  # where a constraint starts, as the client said
    logit_bias: dict[str, float] | None = None  # str keys, as OpenAI sends them

    def params(self, i: int = 0, schema: tuple[str, bool] | None = None, tag: str | None = None,
               after: str | None = None) -> SamplingParams:
        """Choice i's engine parameters; `after`: where a constraint starts unless the client said."""
        knobs: dict[str, Any] = {  # None: SamplingParams' own default
            "max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": None if self.seed is None else self.seed + i,
            "grammar_after": after if self.grammar_after is None else self.grammar_after}
        return SamplingParams(
            **{k: v for k, v in knobs.items() if v is not None}, min_new_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            return_logprob=self.logprobs, top_logprobs_num=self.top_logprobs,
            json_schema=schema[0] if schema else None, strict_json_schema=bool(schema and schema[1]),
            regex=self.regex, ebnf=self.ebnf, structural_tag=tag,
            logit_bias=cast(dict[int | str, float] | None, self.logit_bias))


def sampling_params(plan: Plan, s: Sampling) -> list[SamplingParams]:
    """One per choice (of a constrained plan). With a reasoning parser a constraint starts after
    the reasoning; calls marked with special tokens (plan.keep_markers) are decoded with them."""
    constrained = any(x is not None for x in (plan.schema, plan.tag, s.regex, s.ebnf))
    whole = plan.parser == "harmony" and plan.call_tag  # a harmony call tag holds every message, the analysis too
    after = None if whole else reasoning.grammar_after(plan.parser, constrained)
    s = replace(s, skip_special_tokens=s.skip_special_tokens and not plan.keep_markers)
    return [s.params(i, plan.schema, plan.tag, after) for i in range(s.n)]


def prepare(plan: Plan, s: Sampling, reasoning_parser: str | None) -> list[SamplingParams]:
    """A translated plan constrained (a client's regex or EBNF leaves auto calls free), and its
    choices' sampling parameters."""
    constrain(plan, reasoning_parser, free=s.regex is None and s.ebnf is None)
    return sampling_params(plan, s)


@dataclass
class Rendered:
    """A prompt as rendered (off the loop, at admission): what a Responses turn stores."""

    text: str = ""
    ids: list[int] = field(default_factory=list)


def renderer(engine: EngineClient, plan: Plan, rename: dict[str, str], prefix: tuple[str, list[int]] | None = None,
             into: Rendered | None = None) -> Callable[[], list[int]]:
    """The prompt's token ids, built off the event loop (a long history is real work): the
    model's chat template (engine.chat_ids; `prefix`: a stored turn's text and ids, reused
    where the text starts with it), then the prefill. `rename`: the engine's field names in
    the API's; its "prompt" is the field the conversation came in."""
    template = getattr(engine.tokenizer, "chat_template", None)
    where = rename["prompt"]

    def render() -> list[int]:
        messages, specs = tools.render(plan.messages, plan.offered, template)
        text: list[str] = []
        try:
            ids = engine.chat_ids(messages, specs, plan.template_kwargs or None, prefix, text.append)
            if plan.prefill:
                ids = [*ids, *engine.tokenizer.encode(plan.prefill, add_special_tokens=False)]
        except ValueError as e:  # e.g. a text that cannot fit the context window
            raise value_error(e, rename) from None
        except Exception as e:  # the template's own checks (e.g. role order)
            them = "them" if where == "messages" else "it"
            raise ApiError(400, f"{where}: the model's chat template rejected {them}: {e}", param=where) from None
        if into is not None:
            into.text, into.ids = text[0], ids
        return ids

    return render


@asynccontextmanager
async def admit(state: ServerState, tenant: Tenant, plan: Plan, prompts: Sequence[Callable[[], list[int]]],
                params: Sequence[SamplingParams], opts: RequestOptions, arrival: float) -> AsyncIterator[Flight]:
    """state.admit, with a constrained call's compile errors naming the tools: the call schema's
    field (plan.call_field) is renamed to the one callable tool's parameters, and an error
    pointing into them names that tool (tools.blame)."""
    if plan.call_field is not None:
        opts.rename = {**opts.rename, plan.call_field[0]: plan.call_field[1]}
    try:
        async with state.admit(tenant, prompts, params, opts, arrival) as flight:
            yield flight
    except ApiError as e:
        if plan.call_field is None:
            raise
        raise tools.blame(e, plan.offered, plan.callable, plan.tool_schemas) from None


async def begin(request: web.Request, typ: type, admit: bool = True) -> tuple[ServerState, float, Tenant, Any]:
    """Every chat route starts alike: the clock, the tenant, an overloaded server's refusal
    before the body is read (`admit` False: a route that queues nothing), the body, the model."""
    state: ServerState = request.app["state"]
    arrival = time.monotonic()
    tenant = request.get(TENANT_KEY) or state.auth.of_request(request)  # (the rate limiter's, when it found it)
    if admit:
        state.admission.check(tenant)
    b = await read_body(request, typ)
    state.adapter_of(b.model)  # an unknown model: 404 before anything runs
    return state, arrival, tenant, b


@dataclass
class Call:
    """One chat call as its stages see it: the HTTP request, the server, who asks, when it
    arrived, and its decoded body (the API's wire type)."""

    request: web.Request
    state: ServerState
    tenant: Tenant
    arrival: float
    body: Any


@dataclass
class Turn:
    """An API's translation of a call: what to run and how its reply is shaped.

    `prefix`: a stored turn (text, ids) the rendering reuses; `rendered`: where the prompt as
    rendered goes (a Responses turn stores it); `wrap`: the renderer wrapped (Messages' cache
    breakpoints); `data`: the API's own (what its reply needs). One prompt runs per choice
    (the sampling's n)."""

    plan: Plan
    sampling: Sampling
    options: RequestOptions
    prefix: tuple[str, list[int]] | None = None
    rendered: Rendered | None = None
    wrap: Callable[[Callable[[], list[int]]], Callable[[], list[int]]] | None = None
    data: Any = None


@dataclass(frozen=True)
class Api:
    """A chat API on the core: its body's wire type, its field names for the engine's (`rename`,
    whose "prompt" is the field the conversation came in), the translation in (no await but a
    store read) and the reply (whole or streamed, from the admitted flight)."""

    body: type
    rename: dict[str, str]
    translate: Callable[[Call], Awaitable[Turn]]
    reply: Callable[[Call, Turn, Flight], Awaitable[web.StreamResponse]]


async def serve(request: web.Request, api: Api) -> web.StreamResponse:
    """One chat request, each stage once, in order (the module docstring)."""
    state, arrival, tenant, body = await begin(request, api.body)
    call = Call(request, state, tenant, arrival, body)
    turn = await api.translate(call)
    turn.options.lora = state.adapter_of(body.model)
    params = prepare(turn.plan, turn.sampling, state.config.reasoning_parser)
    render = renderer(state.engine, turn.plan, api.rename, turn.prefix, turn.rendered)
    if turn.wrap is not None:
        render = turn.wrap(render)
    async with admit(state, tenant, turn.plan, [render] * len(params), params, turn.options, arrival) as flight:
        resp = await api.reply(call, turn, flight)
    if state.history is not None:  # (its runs have ended: each ticket holds its output)
        state.history.after_turn(tenant, turn, flight)
    return resp


def route(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler of an API's chat route."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await serve(request, api)

    return handler
