"""/openapi.json, generated from the protocol Structs (one source of truth for the shapes)."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from radixserve.server.protocol import REQUEST_TYPES, RESPONSE_TYPES, ErrorResponse

_SUMMARIES = {
    "/generate": "Generate (native, SGLang-style); `stream: true` answers with server-sent events",
    "/v1/chat/completions": "OpenAI chat completions",
    "/v1/completions": "OpenAI completions",
    "/v1/models": "The served model",
    "/abort_request": "Abort an in-flight request by rid",
    "/model_info": "The served model (also at SGLang's GET /get_model_info)",
    "/concate_and_append_request": "SGLang's parallel-encoding join: acknowledged (the joined text is computed from the cache)",
}
_ERRORS = {400: "bad input", 401: "missing or invalid API key", 404: "unknown model or rid", 413: "body too large",
           429: "tenant over its queue share", 503: "overloaded or shutting down"}


@cache
def _document(model: str) -> dict[str, Any]:
    types = [*REQUEST_TYPES.values(), *RESPONSE_TYPES.values(), ErrorResponse]
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    by_type = dict(zip(types, refs))
    err = {"content": {"application/json": {"schema": by_type[ErrorResponse]}}}
    paths: dict[str, Any] = {}
    for path in sorted(set(REQUEST_TYPES) | set(RESPONSE_TYPES)):
        op: dict[str, Any] = {"summary": _SUMMARIES.get(path, path), "responses": {}}
        if path in REQUEST_TYPES:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": by_type[REQUEST_TYPES[path]]}}}
        ok_schema = by_type[RESPONSE_TYPES[path]] if path in RESPONSE_TYPES else {"type": "object"}
        op["responses"]["200"] = {"description": "OK", "content": {"application/json": {"schema": ok_schema}}}
        for status, text in _ERRORS.items():
            op["responses"][str(status)] = {"description": text, **err}
        paths[path] = {"post" if path in REQUEST_TYPES else "get": op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": "0.1.0", "description": f"Serving {model}"},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def openapi_document(model: str) -> dict[str, Any]:
    return _document(model)
