"""SGLang-style native API: POST /generate (text or input_ids, single or batched, streaming)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.request import FinishReason, SamplingParams
from radixserve.server.body import read_body
from radixserve.server.errors import ApiError, prompt_batch
from radixserve.server.protocol import GenerateRequest, GenerateResponse, MetaInfo, NativeFinishReason, NativeSamplingParams
from radixserve.server.sse import SSEWriter
from radixserve.server.state import Flight, RequestOptions, ServerState, public_rid

GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


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


def _params(body: GenerateRequest, sp: NativeSamplingParams) -> SamplingParams:
    if not 0 <= body.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs_num: {body.top_logprobs_num} is out of range [0, {MAX_TOP_LOGPROBS}]",
                       param="top_logprobs_num")
    fields = {f: getattr(sp, f) for f in sp.__struct_fields__}
    return SamplingParams(**fields, return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                          logprob_start_len=body.logprob_start_len)


def _finish(out: Output) -> NativeFinishReason:
    if out.finish_reason == FinishReason.ERROR.value:
        return NativeFinishReason("error", message=out.error)
    return NativeFinishReason(out.finish_reason, matched=out.matched_stop)


def _response(state: ServerState, out: Output, text: str, ids: list[int], arrival: float, final: bool) -> GenerateResponse:
    tokens, top = state.triples(out.logprobs)
    ptokens, ptop = state.triples(out.prompt_logprobs)
    meta = MetaInfo(public_rid(out.rid), out.prompt_tokens, len(ids), out.cached_tokens, _finish(out) if final else None,
                    time.monotonic() - arrival, tokens, top, ptokens, ptop)
    return GenerateResponse(text, ids, meta)


async def generate(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    arrival = time.monotonic()
    tenant = state.authenticate(request)
    state.admission.check(tenant)  # overloaded: refused before the body is read
    body = await read_body(request, GenerateRequest)
    prompts, batched = _prompts(body)
    if batched and body.stream:
        raise ApiError(400, "stream: streaming a batch of prompts is not supported; send them as separate requests",
                       param="stream")
    params = _params(body, body.sampling_params or NativeSamplingParams())
    opts = RequestOptions(body.rid, body.priority, body.cache_salt, body.public_prefix_len,
                          rename={"prompt": "text", "input_ids": "input_ids", **{k: f"sampling_params.{k}" for k in GRAMMARS}})
    async with state.admit(tenant, prompts, [params] * len(prompts), opts, arrival) as flight:
        if not body.stream:
            outs = await state.collect(flight)
            resp = [_response(state, o, o.text, o.token_ids, arrival, True) for o in outs]
            return web.Response(body=msgspec.json.encode(resp if batched else resp[0]), content_type="application/json")
        return await _stream(request, state, flight, params.return_logprob)


async def _stream(request: web.Request, state: ServerState, flight: Flight, logprobs: bool) -> web.StreamResponse:
    sse = await SSEWriter.open(request)
    req, text, ids = flight.reqs[0], "", []
    async for _, d in state.merged(flight):
        # text and output_ids are cumulative (SGLang's shape); logprobs are those of the new tokens only
        text, ids = text + d.text, ids + d.token_ids
        out = d.output or Output(req.rid, "", [], "", req.prompt_len, len(ids), d.cached_tokens)
        new_lps = d.logprobs if logprobs else None
        out = Output(**{**vars(out), "logprobs": new_lps, "prompt_logprobs": out.prompt_logprobs if d.finished else None})
        await sse.send(_response(state, out, text, ids, flight.arrival, d.finished))
    await sse.done()
    return sse.response
