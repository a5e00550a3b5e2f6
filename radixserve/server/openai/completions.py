"""OpenAI-compatible /v1/completions."""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.request import TokenLogprob
from radixserve.server.chat.reasoning import ended_early, finish_reason
from radixserve.server.errors import ApiError, prompt_batch
from radixserve.server.openai.chat import (
    MAX_TOP_LOGPROBS,
    RENAME,
    begin,
    include_usage,
    request_options,
    sampling_params,
    usage,
)
from radixserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from radixserve.server.sse import SSEWriter
from radixserve.server.state import Flight, ServerState


def _completion_prompts(b: CompletionRequest) -> list[str | list[int]]:
    prompts = [b.prompt] if isinstance(b.prompt, str) else prompt_batch(b.prompt, "prompt", texts_ok=True)[0]
    if any(len(x) == 0 for x in prompts):
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    return prompts


def _completion_logprobs(state: ServerState, lps: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
    if lps is None:
        return None
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        s = state.token_text(lp.token_id)
        tokens.append(s)
        offset += len(s)
    tops: list[dict[str, float] | None] = [{state.token_text(t): v for v, t in lp.top} for lp in lps]
    return CompletionLogprobs(tokens, [lp.logprob for lp in lps], tops, offsets)


async def completions(request: web.Request) -> web.StreamResponse:
    state, arrival, tenant, b = await begin(request, CompletionRequest)
    if b.suffix:
        raise ApiError(400, "suffix: is not supported", param="suffix")
    if b.best_of is not None and b.best_of != b.n:
        raise ApiError(400, "best_of: only best_of == n is supported", param="best_of")
    top = b.logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs: {top} is out of range [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    if b.echo and top is not None:
        raise ApiError(400, "echo: echo together with logprobs is not supported", param="echo")
    prompts = _completion_prompts(b)
    max_tokens = 16 if b.max_tokens is None else b.max_tokens  # OpenAI's default for completions
    flat = [p for p in prompts for _ in range(b.n)]
    params = [sampling_params(b, max_tokens, i % b.n, top or 0, top is not None) for i in range(len(flat))]
    opts = request_options(b)
    opts.rename = {**RENAME, "prompt": "prompt", "input_ids": "prompt"}
    opts.lora = state.adapter_of(b.model)
    async with state.admit(tenant, flat, params, opts, arrival) as flight:
        return await _reply(request, state, b, flight, flat, len(prompts))


async def _reply(request: web.Request, state: ServerState, b: CompletionRequest, flight: Flight,
                 flat: list[str | list[int]], n_prompts: int) -> web.StreamResponse:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    top = b.logprobs

    def echo(i: int) -> str:
        p = flat[i]
        return (p if isinstance(p, str) else state.engine.tokenizer.decode(p)) if b.echo else ""

    if not b.stream:
        outs = await state.collect(flight)
        choices = [CompletionChoice(i, echo(i) + o.text, finish_reason(o), _completion_logprobs(state, o.logprobs, 0))
                   for i, o in enumerate(outs)]
        resp = CompletionResponse(cid, created, state.answered_by(b.model), choices, usage(outs, n_prompts))
        return web.Response(body=msgspec.json.encode(resp), content_type="application/json")
    sse = await SSEWriter.open(request)
    finals: list[Output | None] = [None] * len(flight.reqs)
    started = [False] * len(flight.reqs)
    offsets = [0] * len(flight.reqs)  # text_offset runs on across a choice's chunks
    async for i, d in state.merged(flight):
        reason = None
        if d.finished and d.output is not None:
            finals[i] = d.output
            if (err := ended_early(d.output)) is not None:  # an error event, never a finish reason
                await sse.send(err.body())
                continue
            reason = finish_reason(d.output)
        text = (echo(i) if not started[i] else "") + d.text
        started[i] = True
        lps = _completion_logprobs(state, d.logprobs, offsets[i]) if top is not None and d.logprobs else None
        if lps is not None:
            offsets[i] = lps.text_offset[-1] + len(lps.tokens[-1])
        if text or reason or lps:
            await sse.send(CompletionResponse(cid, created, state.answered_by(b.model), [CompletionChoice(i, text, reason, lps)]))
    if include_usage(b):
        await sse.send(CompletionResponse(cid, created, state.answered_by(b.model), [], usage([o for o in finals if o], n_prompts)))
    await sse.done()
    return sse.response
