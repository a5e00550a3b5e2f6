"""build_app: routes, JSON errors for everything (never an HTML page or a bare 500), and the
small endpoints (health, server_info, flush_cache, abort_request, metrics, openapi.json)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from radixserve.engine.front import ON_STALL
from radixserve.engine.protocol import EngineStats
from radixserve.request import SamplingParams
from radixserve.server import access_log, rate_limit
from radixserve.server.anthropic import routes as anthropic
from radixserve.server.auth import request_key
from radixserve.server.body import read_body, too_large
from radixserve.server.chat.history import HISTORY_HELP, HistoryWarmer
from radixserve.server.errors import ApiError
from radixserve.server.metrics import CountersCollector, kv_cache_usage
from radixserve.server.openai import chat as openai
from radixserve.server.openai import completions, lora
from radixserve.server.openapi import DOCUMENT, openapi_document
from radixserve.server.protocol import AbortRequest, ModelInfo
from radixserve.server.responses import routes as responses
from radixserve.server.sglang import generate as native
from radixserve.server.state import ServerState, engine_rids

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    arrival = time.monotonic()
    if request.transport is not None:  # a stream cut off for its unread backlog drops its connection
        ON_STALL.set(request.transport.abort)  # not close(): that waits to flush what nobody reads
    try:
        return await handler(request)
    except ApiError as e:
        err = e
    except web.HTTPRequestEntityTooLarge:
        err = too_large(state.config.max_request_bytes)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(e.status, f"{request.method} {request.path}: {e.reason}")
    except ConnectionError:  # the client left; its request was aborted on the way out
        raise asyncio.CancelledError from None  # how aiohttp itself reports a gone client (no traceback in the log)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        err = ApiError(500, "internal server error", code="internal_error")
    state.metrics.rejected.labels(err.code or str(err.status)).inc()
    if err.status in (429, 503):
        state.metrics.rejection_latency.observe(time.monotonic() - arrival)
    resp = err.response()
    if err.status in (408, 413) or (err.code == "rate_limited" and _body_unread(request)):
        resp.force_close()  # the rest of the body is never read: close rather than drain it
    return resp


def _body_unread(request: web.Request) -> bool:
    """A body is coming that nobody read (more than a small one's worth, which is cheaper to drain
    than the connection is to open again)."""
    length = request.content_length
    return request.body_exists and (length is None or length > 65536) and not request.content.at_eof()


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    if state.engine_down() is not None:
        return _json({"status": "engine_down"}, 503)
    if state.admission.draining:
        return _json({"status": "draining"}, 503)
    return _json({"status": "ok"})


HEALTH_GENERATE_TIMEOUT_S = 20.0


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's /health_generate: like /health, and the engine must also generate one token
    (from a one-token prompt, greedy) within HEALTH_GENERATE_TIMEOUT_S."""
    state: ServerState = request.app["state"]
    down = await health(request)
    if down.status != 200:
        return down
    req = state.engine.make_req([0], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async with contextlib.aclosing(state.engine.submit(req)) as stream:  # left early: aborted, KV freed
                async for d in stream:
                    if d.finished:
                        break
    except TimeoutError:
        return _json({"status": "engine_unresponsive"}, 503)
    return _json({"status": "ok"})


async def server_info(request: web.Request) -> web.Response:
    """The server's configuration; an admin also sees the KV accounting and every tenant's
    counters (kv, kv_tiers, tenants, ...), any other tenant its own only. `?check_integrity=1`
    (admin only) also checks that every KV page is free, cached or owned by exactly one request."""
    state: ServerState = request.app["state"]
    tenant = state.auth.of_request(request)
    e, c = state.engine, state.config
    extra: dict[str, Any] = {}
    if tenant.admin:  # the global counters say what every tenant sent (and what the cache holds): admins only
        adm = state.admission
        snap = e.snapshot()
        extra.update(queued=adm.queued, in_flight=adm.in_flight, kv=dataclasses.asdict(snap), kv_tiers=_kv_tiers(snap),
                     engine_pid=e.pid,
                     autoscaling={"waiting": snap.waiting, "waiting_tokens": snap.waiting_tokens, "running": snap.running,
                                  "kv_usage": round(kv_cache_usage(snap), 4),
                                  "ttft_p90_s": round(state.metrics.ttft_p90(), 4),  # seen, not scaled on (ray/autoscale.py)
                                  "ttft_per_1k_p90_s": round(state.metrics.ttft_per_1k_p90(), 4)},
                     speculative_stats=spec_stats(e.snapshot()),
                     tenants={t: vars(u) for t, u in state.usage.items()},
                     open_connections=state.connections.open if state.connections else None)
        if (replicas := e.describe()) is not None:
            extra["data_parallel"] = replicas
    else:
        extra["tenant"] = state.tenant_info(tenant)
    if request.query.get("check_integrity") in ("1", "true"):
        if not tenant.admin:
            raise ApiError(403, "check_integrity: only an admin tenant may check the KV pool", code="not_admin")
        try:
            await state.off_loop(e.check_integrity)
            extra["integrity"] = "ok"
        except Exception as err:  # the message names the broken invariant
            extra["integrity"] = f"{type(err).__name__}: {err}"
    return _json({
        "model": state.model_name,
        "model_path": str(e.model_path),
        "max_context_len": e.context_len,
        "chat_template": getattr(e.tokenizer, "chat_template", None),
        "tool_call_parser": state.tool_format,
        "vocab_size": e.vocab_size,
        "dtype": str(e.dtype).removeprefix("torch."),
        "quantization": e.quantization,
        "activations": e.activations,
        "weight_bytes": e.weight_bytes,
        "step_weight_bytes": e.step_weight_bytes,
        "experts": e.experts and {**e.experts, "expert_parallel": e.config.model.expert_parallel},
        "load": {"seconds": round(e.load_seconds, 3), "peak_rss_bytes": e.load_peak_rss},
        "cpu_kernels": e.cpu_kernels or None,
        "max_queued_requests": c.max_queued_requests,
        "max_request_bytes": c.max_request_bytes,
        "max_connections_per_client": c.max_connections_per_client,
        "max_running_requests": e.config.sched.max_running_requests,
        "page_size": e.config.cache.page_size,
        "radix_cache": not e.config.cache.disable_radix_cache,
        "history": state.history.info() if state.history is not None else None,
        "speculative": _spec_config(e.config.spec, str(e.device)),
        **_kv_pool(e.snapshot()),
        **extra,
    })


def _kv_pool(s: EngineStats) -> dict[str, Any]:
    """What the KV pool stores (the configuration, for every tenant): its dtype, a token's bytes
    (scales included), its tokens; with sliding-window layers in a pool of their own, that
    pool's tokens."""
    out = {"kv_cache_dtype": s.kv_dtype, "kv_bytes_per_token": s.kv_bytes_per_token, "kv_capacity_tokens": s.kv_total_slots,
           "kv_pool_bytes": s.kv_pool_bytes}
    if s.kv_window_total_slots:
        out["kv_window_capacity_tokens"] = s.kv_window_total_slots
    return out


def _kv_tiers(s: EngineStats) -> dict[str, Any]:
    """Per tier (the pool, the disk tier) what it holds and the prompt tokens it served: every
    tenant's traffic, so admins only."""
    tiers = {"device": {"cached_tokens": s.kv_cached_tokens, "capacity_tokens": s.kv_total_slots,
                        "cache_hit_prompt_tokens": s.cached_prompt_tokens - s.cached_prompt_tokens_disk}}
    if s.kv_disk_capacity_bytes:
        tiers["disk"] = {"blocks": s.kv_disk_blocks, "bytes": s.kv_disk_bytes, "capacity_bytes": s.kv_disk_capacity_bytes,
                         "cache_hit_prompt_tokens": s.cached_prompt_tokens_disk, "written_tokens": s.kv_disk_written_tokens,
                         "skipped_tokens": s.kv_disk_skipped_tokens, "loaded_tokens": s.kv_disk_loaded_tokens,
                         "corrupt_blocks": s.kv_disk_corrupt_blocks}
    return tiers


def _spec_config(c: Any, device: str) -> dict[str, Any] | None:
    if c.speculative == "none":
        return None
    return {"method": c.speculative, "max_draft": c.spec_max_draft, "ngram_min": c.spec_ngram_min, "ngram_max": c.spec_ngram_max,
            "max_batch": c.spec_max_batch, "fixed_cost_rows": c.fixed_cost(device.split(":")[0])}


def spec_stats(s: EngineStats) -> dict[str, Any]:
    """Drafted and accepted tokens, the acceptance rate, and the tokens a decode with a draft
    produced on average (accepted draft tokens plus the one it always samples)."""
    return {"draft_tokens": s.spec_draft_tokens, "accepted_tokens": s.spec_accepted_tokens,
            "acceptance_rate": s.spec_acceptance_rate, "verifies": s.spec_verifies,
            "tokens_per_verify": s.spec_tokens_per_verify,
            "cache_draft_tokens": s.spec_cache_draft_tokens, "cache_accepted_tokens": s.spec_cache_accepted_tokens}


async def model_info(request: web.Request) -> web.Response:
    """What SGLang's client reads first (`RuntimeEndpoint` calls GET /get_model_info)."""
    state: ServerState = request.app["state"]
    state.auth.of_request(request)
    path = state.engine.model_path
    hf = _hf_config(path)
    return _json(ModelInfo(str(path), state.model_name, str(path), True, state.engine.context_len,
                           model_type=hf.get("model_type"), architectures=hf.get("architectures")))


def _hf_config(path: Any) -> dict[str, Any]:
    """The model folder's config.json (nothing for a single .gguf file)."""
    try:
        with open(Path(path) / "config.json", "rb") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


async def flush_cache(request: web.Request) -> web.Response:
    """`?keep_disk=1`: drop the pool's prefixes only; the disk tier keeps its blocks (a later
    prompt reads them back, as after an eviction)."""
    state: ServerState = request.app["state"]
    if not state.auth.of_request(request).admin:
        raise ApiError(403, "flush_cache: only an admin tenant may flush the shared prefix cache", code="not_admin")
    keep = request.query.get("keep_disk", "0")
    if keep not in ("0", "1", "true", "false"):
        raise ApiError(400, f"keep_disk: must be 0, 1, true or false, got {keep!r}", param="keep_disk")
    try:
        dropped = await state.off_loop(state.engine.flush_cache, keep in ("1", "true"))
    except RuntimeError as e:
        raise ApiError(400, str(e), code="busy") from None
    return _json({"flushed_tokens": dropped})


async def abort_request(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    tenant = state.auth.of_request(request)
    body = await read_body(request, AbortRequest)
    for rid in ((engine_rids(tenant, body.rid, 1) or [body.rid])[0], body.rid):  # the caller's rid, or a server-made one
        req = state.active.get(rid)
        if req is not None and req.tenant == tenant.id:  # another tenant's request is as good as unknown
            state.engine.abort(rid)
            return _json({"aborted": body.rid})
    raise ApiError(404, f"rid: no request {body.rid!r} is in flight", param="rid")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text. Its counters describe every tenant's traffic, so when keys are configured
    it needs an admin key or --metrics-key."""
    state: ServerState = request.app["state"]
    if not state.auth.open or state.config.metrics_key:
        key = request_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        metrics_key = state.config.metrics_key
        if not (metrics_key and key and hmac.compare_digest(key.encode("utf-8", "surrogateescape"), metrics_key.encode())):
            if state.auth.open:
                raise ApiError(401, "metrics: send the --metrics-key as 'Authorization: Bearer <key>'", code="invalid_api_key")
            if not state.auth.of_request(request).admin:
                raise ApiError(403, "metrics: only an admin key or the --metrics-key may read /metrics", code="not_admin")
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def openapi(request: web.Request) -> web.Response:
    """This server's OpenAPI document: every route, its summary and shapes."""
    return _json(request.app[DOCUMENT])


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[access_log.middleware, errors, rate_limit.middleware],
                          client_max_size=state.config.max_request_bytes)
    app["state"] = state
    if getattr(state, "history", False) is None:  # the chat core's history precomputes, counted in /metrics
        state.history = HistoryWarmer(state)
        state.metrics.registry.register(CountersCollector("radixserve_history_", state.history.counters, HISTORY_HELP))
    app.router.add_post("/generate", native.generate)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_get("/v1/models", openai.models)
    app.router.add_get("/v1/models/{model:.+}", openai.model)  # names may hold slashes
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)  # SGLang's (its Runtime waits on it): one token generated
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)  # SGLang's older name
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_model_info", model_info)  # what SGLang's RuntimeEndpoint calls
    app.router.add_post("/concate_and_append_request", native.concat_and_append)  # SGLang's spelling
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/v1/load_lora_adapter", lora.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", lora.unload_lora_adapter)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    responses.add_routes(app)
    anthropic.add_routes(app)
    app[DOCUMENT] = openapi_document(app, state.model_name)  # once every route is on the app
    return app
