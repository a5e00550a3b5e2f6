"""What every route shares (engine, auth, admission, metrics) and how one engine request is
run from the event loop: tokenize and validate off the loop, stream its deltas, and on every
path (finish, error, disconnect) release its admission ticket and record its metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.config import ServerConfig
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.protocol import EngineClient, EngineDied
from radixserve.request import Req, Retention, SamplingParams, TokenLogprob, distinct_prompts
from radixserve.server import access_log
from radixserve.server.admission import Admission, Ticket, request_priority
from radixserve.server.auth import DEFAULT_RETENTION, Auth, Tenant
from radixserve.server.errors import ApiError, value_error
from radixserve.server.metrics import Metrics
from radixserve.server.rate_limit import RateLimiter

log = logging.getLogger(__name__)

T = TypeVar("T")
Prompt = str | list[int]


def engine_rids(tenant: Tenant, rid: str | None, n: int) -> list[str] | None:
    """A caller's rid lives in its tenant's space (no tenant can collide with or probe another's);
    a batch gets rid-0, rid-1, ..."""
    if rid is None:
        return None
    base = f"{tenant.id}/{rid}"
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def public_rid(engine_rid: str) -> str:
    """The rid as the caller knows it."""
    return engine_rid.split("/", 1)[1] if "/" in engine_rid else engine_rid


def check_retention(tenant: Tenant, seconds: int, param: str) -> None:
    """A retention longer than the tenant's max_cache_retention is a 400 naming the field."""
    if seconds > tenant.retention_cap:
        raise ApiError(400, f"{param}: tenant {tenant.id!r} may keep a prompt cached for at most "
                            f"{tenant.max_cache_retention or DEFAULT_RETENTION} ({tenant.retention_cap} s), this asks "
                            f"{seconds} s (the server's tenants file sets max_cache_retention)",
                       param=param, code="retention_not_allowed")


@dataclass
class RequestOptions:
    """What a route asks of the engine besides the prompt and sampling parameters."""

    rid: str | None = None
    priority: int | None = None
    cache_salt: str | None = None
    public_prefix_len: int | None = None
    rename: dict[str, str] = field(default_factory=dict)  # engine field name -> this API's name
    # OpenAI's prompt_cache_key: the client's hint of which requests share a long prefix, for a
    # router to send them to one replica. Not a cache namespace: salting by it would keep users
    # from sharing a system prompt, the opposite of what the client asks for.
    prompt_cache_key: str | None = None
    retention: Retention | None = None  # how long the prompt stays cached (prompt_cache_retention, cache_control)
    # no max tokens given: what the context window leaves after the prompt (the OpenAI APIs, as
    # vLLM); False: the engine's default_max_new_tokens (/generate, as SGLang's 128)
    rest_of_window: bool = True
    lora: str | None = None  # the LoRA adapter the request's model names (None: the base model)


def _aborted(req: Req, last: Delta | None, tokens: int) -> Output:
    """What a request left early had used, as far as its deltas told (the engine's own state
    may be in another process)."""
    return Output(req.rid, "", [], "abort", req.prompt_len, tokens, last.cached_tokens if last is not None else 0)


@dataclass
class Flight:
    """One call's admitted requests and their tickets (index i of each belongs together)."""

    tickets: list[Ticket]
    arrival: float
    reqs: list[Req] = field(default_factory=list)
    admitted: bool = False  # tokenized, validated and compiled: handed to the route
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)  # what runs its requests (collect, merged)


@dataclass
class TenantUsage:
    """What one tenant's finished requests used: /server_info shows a tenant only its own."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: Output) -> None:
        self.requests += 1
        self.prompt_tokens += out.prompt_tokens
        self.cached_tokens += out.cached_tokens
        self.completion_tokens += out.completion_tokens


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    auth: Auth
    model_name: str
    admission: Admission = field(init=False)
    metrics: Metrics = field(init=False)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="radixserve-tok"))
    active: dict[str, Req | None] = field(default_factory=dict)  # engine rid -> request, while in flight
    created: int = field(default_factory=lambda: int(time.time()))
    token_texts: list[str] | None = None
    usage: defaultdict[str, TenantUsage] = field(default_factory=lambda: defaultdict(TenantUsage))
    connections: Any = None  # the server's ConnectionLimits, once it listens
    rate_limiter: RateLimiter = field(default_factory=RateLimiter)  # tenants' max_requests_per_second
    tool_format: str = "hermes"  # how the model writes tool calls (serve.py: chat.tool_parsers.for_server)
    history: Any = None  # the chat history precomputes (chat.history.HistoryWarmer: build_app sets it)
    loras: dict[str, dict[str, Any]] = field(default_factory=dict)  # LoRA adapters served: name -> what the engine said

    def __post_init__(self) -> None:
        c = self.config
        self.admission = Admission(c.max_queued_requests)
        self.metrics = Metrics(self.engine.snapshot, lambda: self.admission.queued, c.slo_ttft_ms / 1e3, c.slo_tpot_ms / 1e3,
                               lambda: self.connections.open if self.connections is not None else 0,
                               replicas=self.engine.replica_snapshots, vllm_names=c.metrics_vllm_names)
        self.loras = {a["name"]: a for a in self.engine.loras()}

    def answered_by(self, model: str | None) -> str:
        """The `model` an answer names: the adapter the request chose, else the served model."""
        return model if model and model in self.loras else self.model_name

    def adapter_of(self, model: str | None, param: str = "model") -> str | None:
        """The LoRA adapter a request's `model` (or another `param`) names (None: the base
        model); 404 for a name this server does not serve."""
        if not model or model == self.model_name:
            return None
        if model in self.loras:
            return model
        served = ", ".join(map(repr, [self.model_name, *self.loras]))
        raise ApiError(404, f"{param}: {model!r} is not served; this server serves {served}", param=param,
                       code="model_not_found")

    def engine_down(self) -> str | None:
        """Why the engine core is gone (its process died), or None while it serves."""
        why = getattr(self.engine, "dead", None)
        return why if why not in (None, "shut down") else None

    def tenant_info(self, tenant: Tenant) -> dict[str, Any]:
        """One tenant's own view: its queue, in-flight requests and usage, nothing of others'."""
        adm = self.admission
        return {"id": tenant.id, "queued": adm.by_tenant[tenant.id], "in_flight": adm.in_flight_by_tenant[tenant.id],
                **vars(self.usage[tenant.id])}

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- requests ---------------------------------------------------------------------------
    @asynccontextmanager
    async def admit(self, tenant: Tenant, prompts: Sequence[Prompt | Callable[[], Prompt]],
                    params: Sequence[SamplingParams], opts: RequestOptions, arrival: float) -> AsyncIterator[Flight]:
        """Admit (at once, or an ApiError), then tokenize and compile grammars off the event loop.
        A prompt may be a callable (e.g. rendering a chat template), run off the loop too.

        NOTE: the block owns the admission tickets. Leaving it by any path (finish, error, a
        client gone at any await) aborts what still runs and releases each ticket exactly once."""
        if (why := self.engine_down()) is not None:
            raise ApiError(503, f"the engine process is gone ({why}); the server is shutting down", code="engine_down")
        if opts.public_prefix_len and not tenant.allow_public_prefix:
            raise ApiError(403, f"public_prefix_len: tenant {tenant.id!r} may not use the public prefix", param="public_prefix_len")
        if opts.retention is not None:
            check_retention(tenant, opts.retention.seconds, opts.rename.get("prompt_cache_retention", "prompt_cache_retention"))
        priority = request_priority(tenant, opts.priority)
        rids = engine_rids(tenant, opts.rid, len(prompts))
        if rids is not None and any(r in self.active for r in rids):
            raise ApiError(400, f"rid: {opts.rid!r} is already in flight", param="rid")
        flight = Flight(self.admission.enter(tenant, len(prompts), opts.rename.get("n", "n")), arrival)
        for rid in rids or ():
            self.active[rid] = None  # claimed before the first await: a concurrent twin gets the 400
        try:
            flight.reqs = await self.off_loop(self._make_reqs, tenant, prompts, params, rids, opts, priority)
            texts = None
            if self.config.log_requests:  # the access log's prompt texts, decoded off the loop
                texts = await self.off_loop(access_log.prompt_texts, self.engine.tokenizer, flight.reqs)
            if (entry := access_log.CURRENT.get()) is not None:
                entry.prompt_tokens = (entry.prompt_tokens or 0) + sum(r.prompt_len for r in distinct_prompts(flight.reqs))
                entry.prompts = [*(entry.prompts or []), *texts] if texts is not None else entry.prompts
            for r in flight.reqs:
                self.active[r.rid] = r
            try:
                for r in flight.reqs:  # data-parallel replicas: where each runs (and compiles its grammar)
                    self.engine.route(r, opts.prompt_cache_key)
                for r in flight.reqs:  # compiled in the grammar workers; the request waits here, outside the run queue
                    try:
                        await self.engine.prepare_grammar(r)
                    except ValueError as e:
                        raise value_error(e, opts.rename) from None
            except EngineDied as e:
                raise ApiError(503, f"no engine can take the request now ({e})", code="engine_down",
                               headers={"Retry-After": "1"}) from None
            flight.admitted = True
            yield flight
        finally:
            try:  # its runs end here, not whenever a stream left unclosed is finalized: its rids are free when this returns
                for task in flight.tasks:
                    task.cancel()
                await asyncio.gather(*flight.tasks, return_exceptions=True)
            finally:
                self._land(flight, rids or [])

    def _land(self, flight: Flight, claimed: list[str]) -> None:
        for req, ticket in zip(flight.reqs, flight.tickets):
            if not ticket.left and self.active.get(req.rid) is req:
                self.engine.abort(req.rid)  # a no-op for a request the engine never saw
        for ticket in flight.tickets:
            if not ticket.left:
                self.admission.leave(ticket)
                if flight.admitted and not ticket.ran:  # its client left first (a refused request is no abort)
                    self.metrics.observe(None, time.monotonic() - flight.arrival, 0, "abort")
        running = {req.rid for req, ticket in zip(flight.reqs, flight.tickets) if ticket.ran}
        for rid in {*claimed, *(r.rid for r in flight.reqs)} - running:  # a running one's rid is free once its run ends
            self.active.pop(rid, None)

    def _make_reqs(self, tenant: Tenant, prompts: Sequence[Prompt | Callable[[], Prompt]], params: Sequence[SamplingParams],
                   rids: list[str] | None, opts: RequestOptions, priority: int) -> list[Req]:
        reqs: list[Req] = []
        rendered: dict[int, Any] = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if callable(p):
                p = rendered.setdefault(id(p), p())
            rid = rids[i] if rids is not None else None
            try:
                reqs.append(self.engine.make_req(
                    p, sp, rid, priority, tenant=tenant.id, cache_salt=opts.cache_salt, public_prefix_len=opts.public_prefix_len,
                    retention=opts.retention, tenant_key=tenant.namespace_key,
                    default_max_new_tokens=self.engine.context_len if opts.rest_of_window else None, lora=opts.lora))
            except ValueError as e:
                raise value_error(e, opts.rename) from None
        return reqs

    async def run(self, req: Req, ticket: Ticket, arrival: float) -> AsyncGenerator[Delta, None]:
        """Stream one request. Leaving early (a vanished client) aborts it, freeing its KV."""
        ttft: float | None = None
        out: Output | None = None
        last: Delta | None = None
        tokens = 0
        ticket.ran = True
        try:
            async with aclosing(self.engine.submit(req, max_backlog=self.config.max_stream_backlog)) as stream:
                async for d in stream:
                    last, tokens = d, tokens + len(d.token_ids)
                    if ttft is None and (d.token_ids or d.finished):
                        ttft = time.monotonic() - arrival
                        self.admission.started(ticket)
                    if d.finished:
                        out = d.output
                    yield d
        finally:  # a run ends once: whoever releases the ticket, the request's use is counted here
            ticket.out = out
            self.admission.leave(ticket)
            reason = out.finish_reason if out is not None else "abort"
            used = out if out is not None else _aborted(req, last, tokens)
            self.metrics.observe(ttft, time.monotonic() - arrival, out.completion_tokens if out else 0, reason,
                                 computed_prompt_tokens=used.prompt_tokens - used.cached_tokens)
            self.usage[ticket.tenant].add(used)
            if (entry := access_log.CURRENT.get()) is not None:
                entry.completion_tokens = (entry.completion_tokens or 0) + used.completion_tokens
            if self.active.get(req.rid) is req:  # its rid is free only now: the engine was told to abort it first
                del self.active[req.rid]

    async def collect(self, flight: Flight) -> list[Output]:
        """Run requests together to completion (siblings share their prompt through the cache)."""

        async def one(req: Req, ticket: Ticket) -> Output:
            out = None
            async for d in self.run(req, ticket, flight.arrival):
                out = d.output if d.finished else out
            assert out is not None
            return out

        tasks = [asyncio.ensure_future(one(r, t)) for r, t in zip(flight.reqs, flight.tickets)]
        flight.tasks += tasks
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def merged(self, flight: Flight) -> AsyncGenerator[tuple[int, Delta], None]:
        """Deltas of several requests as they come, tagged with the request's index. The queue is
        bounded: a consumer that stops reading stops the pumps, so each request's own backlog
        (max_stream_backlog) fills and aborts it."""
        q: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue(maxsize=max(self.config.max_stream_backlog, 1))

        async def pump(i: int, req: Req, ticket: Ticket) -> None:
            try:
                async with aclosing(self.run(req, ticket, flight.arrival)) as stream:  # closed (aborting) even if cancelled
                    async for d in stream:
                        await q.put((i, d))
            finally:
                task = asyncio.current_task()
                if task is None or not task.cancelling():  # cancelled: the consumer has gone, nobody waits for the end
                    await q.put(None)

        tasks = [asyncio.ensure_future(pump(i, r, t)) for i, (r, t) in enumerate(zip(flight.reqs, flight.tickets))]
        flight.tasks += tasks
        try:
            done = 0
            while done < len(tasks):
                item = await q.get()
                if item is None:
                    done += 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def build_token_table(self) -> None:
        """Every token's text (models.files.vocab_texts), so logprob replies never decode on the
        loop: an engine process decodes them while its engine loads (`vocab_texts`, a future),
        else they are decoded here, off the loop (until built, `token_text` decodes each one)."""
        from radixserve.models.files import vocab_texts

        tok, n = self.engine.tokenizer, self.engine.vocab_size
        ahead = getattr(self.engine, "vocab_texts", None)
        try:
            texts = await (asyncio.wrap_future(ahead) if ahead is not None else self.off_loop(lambda: vocab_texts(tok, n)))
            self.token_texts = texts[:n] if len(texts) >= n else await self.off_loop(lambda: vocab_texts(tok, n))
        except Exception:  # a tokenizer that cannot decode some id: token_text decodes each one when asked
            log.exception("the token-text table could not be built; logprob replies decode each token")

    def token_text(self, token_id: int) -> str:
        table = self.token_texts
        return table[token_id] if table is not None and 0 <= token_id < len(table) else self.engine.tokenizer.decode([token_id])

    def triples(self, lps: list[TokenLogprob] | None, text: bool) -> tuple[list[Any] | None, list[Any] | None]:
        """SGLang's logprob shape: [logprob, token_id, text] per token (text null unless asked
        for), and the top alternatives."""
        if lps is None:
            return None, None
        name = self.token_text if text else (lambda _: None)
        tokens = [(lp.logprob, lp.token_id, name(lp.token_id)) for lp in lps]
        top = [[(v, t, name(t)) for v, t in lp.top] for lp in lps]
        return tokens, top
