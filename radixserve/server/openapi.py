"""/openapi.json: every route registered on the app, described from the protocol Structs (one
source of truth for the shapes). A route's request and response types come from
protocol.REQUEST_TYPES / RESPONSE_TYPES, this module's table of the small endpoints, or a route
module's `OPENAPI_ROUTES`; a route none of them describes still appears, summarized by its
handler's docstring."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import hdrs, web

from radixserve.server.protocol import REQUEST_TYPES, RESPONSE_TYPES, ErrorResponse, ModelCard, ModelInfo

# (method, path, request Struct or None, response type or JSON schema or None, summary)
Route = tuple[str, str, Any, Any, str]
DOCUMENT = web.AppKey("openapi_document", dict)  # the app's document, built once its routes are added

_STATUS = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
_OBJECT = {"type": "object"}
_METRICS = "metrics"  # the one text/plain reply
ROUTES: list[Route] = [
    ("POST", "/generate", None, None, "Generate (native, SGLang-style); `stream: true` answers with server-sent events"),
    ("POST", "/v1/chat/completions", None, None, "OpenAI chat completions; `stream: true` answers with server-sent events"),
    ("POST", "/v1/completions", None, None, "OpenAI completions; `stream: true` answers with server-sent events"),
    ("GET", "/v1/models", None, None, "The served model and its LoRA adapters (OpenAI's model list; an adapter's parent is the base)"),
    ("GET", "/v1/models/{model}", None, ModelCard, "One model or LoRA adapter by name (404 unless it is served)"),
    ("POST", "/v1/load_lora_adapter", None, _OBJECT, "Serve a LoRA adapter (a PEFT folder) under a name (admin only; vLLM's)"),
    ("POST", "/v1/unload_lora_adapter", None, _OBJECT, "Stop serving a LoRA adapter (admin only; vLLM's)"),
    ("GET", "/health", None, _STATUS, "Liveness: 200 while serving, 503 while draining or with the engine down"),
    ("GET", "/health_generate", None, _STATUS, "Like /health, and the engine must also generate one token"),
    ("GET", "/server_info", None, _OBJECT, "The server's configuration and KV-cache accounting (admins see every tenant)"),
    ("GET", "/get_server_info", None, _OBJECT, "The same as /server_info (SGLang's older name)"),
    ("GET", "/model_info", None, None, "The served model (also at SGLang's GET /get_model_info)"),
    ("GET", "/get_model_info", None, ModelInfo, "The served model (what SGLang's RuntimeEndpoint calls first)"),
    ("POST", "/concate_and_append_request", None, _OBJECT,
     "SGLang's parallel-encoding join: acknowledged (the joined text is computed from the cache)"),
    ("POST", "/flush_cache", None, {"type": "object", "properties": {"flushed_tokens": {"type": "integer"}},
                                    "required": ["flushed_tokens"]},
     "Drop the whole prefix cache (admin only; ?keep_disk=1: the pool only)"),
    ("POST", "/abort_request", None, {"type": "object", "properties": {"aborted": {"type": "string"}}, "required": ["aborted"]},
     "Abort an in-flight request by rid"),
    ("GET", "/metrics", None, _METRICS, "Prometheus metrics (text); needs an admin key or --metrics-key once keys are set"),
    ("GET", "/openapi.json", None, _OBJECT, "This document"),
]
_ERRORS = {400: "bad input", 401: "missing or invalid API key", 403: "not allowed for this tenant",
           404: "unknown model, rid or route", 408: "body not received in time", 413: "body too large",
           429: "tenant over its queue share", 503: "overloaded or shutting down"}


def described_routes() -> list[Route]:
    """This module's table, with the Struct types from protocol.py, then each route module's own."""
    from radixserve.server.anthropic import routes as anthropic
    from radixserve.server.responses import routes as responses

    out = [(m, p, REQUEST_TYPES.get(p) if m == "POST" else req, resp if resp is not None else RESPONSE_TYPES.get(p), s)
           for m, p, req, resp, s in ROUTES]
    for module in (responses, anthropic):
        out.extend(getattr(module, "OPENAPI_ROUTES", []))
    return out


def app_routes(app: web.Application) -> list[tuple[str, str, str]]:
    """(method, OpenAPI path, handler summary) of every route on the app. Left out: HEAD twins of
    GETs, and catch-all (any method) routes, which OpenAPI cannot name and which only answer errors."""
    out = []
    for route in app.router.routes():
        if route.method in ("HEAD", hdrs.METH_ANY) or route.resource is None:
            continue
        doc = (getattr(route.handler, "__doc__", None) or "").strip().split("\n")[0]
        out.append((route.method, route.resource.canonical, doc or f"{route.method} {route.resource.canonical}"))
    return out


def openapi_document(app: web.Application, model: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`'s routes. Built once, after the routes are added."""
    table = {(m, p): (req, resp, s) for m, p, req, resp, s in described_routes()}
    ops = [(m, p, *table.get((m, p), (None, None, doc))) for m, p, doc in app_routes(app)]
    types = [t for _, _, req, resp, _ in ops for t in (req, resp) if t is not None and not isinstance(t, (dict, str))]
    refs, components = msgspec.json.schema_components([*types, ErrorResponse], ref_template="#/components/schemas/{name}")
    schema_of = dict(zip(map(_key, [*types, ErrorResponse]), refs))
    error = {"content": {"application/json": {"schema": schema_of[_key(ErrorResponse)]}}}
    paths: dict[str, dict[str, Any]] = {}
    for method, path, req, resp, summary in ops:
        op: dict[str, Any] = {"summary": summary, "operationId": _operation_id(method, path), "responses": {}}
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in re.findall(r"{(\w+)}", path)]
        if params:
            op["parameters"] = params
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema_of[_key(req)]}}}
        op["responses"]["200"] = {"description": "OK", "content": _content(resp, schema_of)}
        for status, text in _ERRORS.items():
            op["responses"][str(status)] = {"description": text, **error}
        if req is not None:
            op["responses"]["415"] = {"description": "body not sent as Content-Type: application/json", **error}
        if resp is _STATUS:  # the health routes say why they are unavailable in their own shape
            op["responses"]["503"] = {"description": "draining, or the engine is down", "content": _content(resp, schema_of)}
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": "0.1.0", "description": f"Serving {model}"},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def _key(t: Any) -> Any:
    """A hashable key for a type (a union such as `A | list[A]` is one too)."""
    return t if isinstance(t, type) else repr(t)


def _content(resp: Any, schema_of: dict[Any, Any]) -> dict[str, Any]:
    if resp == _METRICS:
        return {"text/plain": {"schema": {"type": "string"}}}
    schema = resp if isinstance(resp, dict) else _OBJECT if resp is None else schema_of[_key(resp)]
    return {"application/json": {"schema": schema}}


def _operation_id(method: str, path: str) -> str:
    return method.lower() + (re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_") or "root")
