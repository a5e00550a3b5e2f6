"""SGLang-style native API: POST /generate (text or input_ids, single or batched, n samples
each, streaming), and the small endpoints SGLang's own client calls."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.limits import MAX_N
from radixserve.request import FinishReason, Retention, SamplingParams
from radixserve.server.body import read_body
from radixserve.server.errors import ApiError, prompt_batch
from radixserve.server.protocol import (
    ConcatAndAppendRequest,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    NativeFinishReason,
    NativeSamplingParams,
)
from radixserve.server.sse import SSEWriter
from radixserve.server.state import Flight, RequestOptions, ServerState, public_rid

NOT_ENGINE = {"n", "spaces_between_special_tokens"}  # sampling_params fields the route itself handles
SAMPLING_NAMES = {f: f"sampling_params.{f}" for f in NativeSamplingParams.__struct_fields__}  # engine name -> ours


def _prompts(body: GenerateRequest) -> tuple[list[Any], bool]:
    """The prompts and whether the request was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "text, input_ids: give exactly one of them", param="text")
    if isinstance(body.text, str):
        return [body.text], False
    if body.text is not None:
        if not body.text:
            raise ApiError(400, "text: a batch of prompts must not be empty", param="text")
        return list(body.text), True
    return prompt_batch(body.input_ids or [], "input_ids", texts_ok=False)


MAX_TOP_LOGPROBS = 20


def _params(body: GenerateRequest, sp: NativeSamplingParams, i: int) -> SamplingParams:
    """Sample i's parameters. Without logprob_start_len, a request that generates nothing
    (scoring a prompt) gets its prompt's logprobs from the first token: there are no output
    logprobs to return (SGLang's client sends such requests for select's unconditional scores)."""
    if not 0 <= body.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs_num: {body.top_logprobs_num} is out of range [0, {MAX_TOP_LOGPROBS}]",
                       param="top_logprobs_num")
    start = body.logprob_start_len
    if start is None:
        start = 0 if body.return_logprob and sp.max_new_tokens == 0 else -1
    fields = {f: getattr(sp, f) for f in sp.__struct_fields__ if f not in NOT_ENGINE}
    if sp.seed is not None:
        fields["seed"] = (sp.seed + i) % 2**63  # n seeded samples differ from each other, as OpenAI's do
    return SamplingParams(**fields, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                          logprob_start_len=start)


def _finish(out: Output) -> NativeFinishReason:
    if out.finish_reason == FinishReason.ERROR.value:
        return NativeFinishReason("error", message=out.error)
    return NativeFinishReason(out.finish_reason, matched=out.matched_stop)


def _response(state: ServerState, body: GenerateRequest, out: Output, text: str, ids: list[int], arrival: float,
              final: bool, logprobs_so_far: int | None = None) -> GenerateResponse:
    named = body.return_text_in_logprobs
    tokens, top = state.triples(out.logprobs, named)
    ptokens, ptop = state.triples(out.prompt_logprobs, named)
    if body.return_logprob and ptokens is None:
        ptokens = []  # asked for logprobs, none of the prompt's: an empty list, as SGLang answers
    length = None if tokens is None else (len(tokens) if logprobs_so_far is None else logprobs_so_far)
    meta = MetaInfo(public_rid(out.rid), out.prompt_tokens, len(ids), out.cached_tokens, _finish(out) if final else None,
                    time.monotonic() - arrival, tokens, top, length, ptokens, ptop)
    return GenerateResponse(text, ids, meta)


def _adapter(state: ServerState, name: str | None) -> str | None:
    """SGLang's lora_path: the adapter's name as loaded (None: the base model)."""
    if name is None:
        return None
    if not name:
        raise ApiError(400, "lora_path: must name a loaded adapter (or be left out for the base model)", param="lora_path")
    return state.adapter_of(name, "lora_path")


async def generate(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    arrival = time.monotonic()
    tenant = state.auth.of_request(request)
    state.admission.check(tenant)  # overloaded: refused before the body is read
    body = await read_body(request, GenerateRequest)
    prompts, batched = _prompts(body)
    sp = body.sampling_params or NativeSamplingParams()
    if not 1 <= sp.n <= MAX_N:
        raise ApiError(400, f"sampling_params.n: {sp.n} is out of range [1, {MAX_N}]", param="sampling_params.n")
    if sp.n > 1:  # SGLang's order: every prompt once, then every prompt again, ...
        prompts, batched = prompts * sp.n, True
    if batched and body.stream:
        raise ApiError(400, "stream: streaming a batch of prompts (or n > 1 samples) is not supported; send them as "
                       "separate requests", param="stream")
    params = [_params(body, sp, i // (len(prompts) // sp.n)) for i in range(len(prompts))]
    batch = "sampling_params.n" if sp.n > 1 else ("text" if body.text is not None else "input_ids")
    opts = RequestOptions(body.rid, body.priority, body.cache_salt, body.public_prefix_len,
                          retention=Retention.named(body.prompt_cache_retention, "prompt_cache_retention"),
                          rename={**SAMPLING_NAMES, "prompt": "text" if body.text is not None else "input_ids", "n": batch},
                          rest_of_window=False,  # SGLang's default: the engine's default_max_new_tokens
                          lora=_adapter(state, body.lora_path))
    async with state.admit(tenant, prompts, params, opts, arrival) as flight:
        if not body.stream:
            outs = await state.collect(flight)
            resp = [_response(state, body, o, o.text, o.token_ids, arrival, True) for o in outs]
            return web.Response(body=msgspec.json.encode(resp if batched else resp[0]), content_type="application/json")
        return await _stream(request, state, body, flight)


async def _stream(request: web.Request, state: ServerState, body: GenerateRequest, flight: Flight) -> web.StreamResponse:
    sse = await SSEWriter.open(request)
    req, text, n_lps = flight.reqs[0], "", 0
    ids: list[int] = []
    async for _, d in state.merged(flight):
        # text and output_ids are cumulative (SGLang's shape); logprobs are those of the new tokens only
        text, ids = text + d.text, ids + d.token_ids
        out = d.output or Output(req.rid, "", [], "", req.prompt_len, len(ids), d.cached_tokens)
        new_lps = d.logprobs if body.return_logprob else None
        n_lps += len(new_lps or ())
        out = Output(**{**vars(out), "logprobs": new_lps, "prompt_logprobs": out.prompt_logprobs if d.finished else None})
        await sse.send(_response(state, body, out, text, ids, flight.arrival, d.finished, n_lps))
    await sse.done()
    return sse.response


async def concat_and_append(request: web.Request) -> web.Response:
    """SGLang's `join("concate_and_append")` asks the server to splice the branches' KV caches
    into the parent's (its "parallel encoding", where each branch's positions restart at the
    fork). radixserve keeps no per-program sessions to splice: the parent's next request sends
    the joined text, whose prefix is cached and whose branch texts are computed once, at their
    true positions (exact attention, where SGLang's splice approximates). So this checks the
    body and acknowledges it; the client then goes on as with any server that supports it."""
    state: ServerState = request.app["state"]
    state.auth.of_request(request)
    body = await read_body(request, ConcatAndAppendRequest)
    return web.Response(body=msgspec.json.encode({"success": True, "src_rids": body.src_rids, "dst_rid": body.dst_rid}),
                        content_type="application/json")
