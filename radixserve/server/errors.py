"""API errors: one exception type, rendered as OpenAI-style JSON `{"error": {...}}`."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from radixserve.limits import MAX_JSON_DEPTH
from radixserve.server.protocol import ErrorDetail, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = ErrorResponse(ErrorDetail(self.message, ERROR_TYPES.get(self.status, "error"), self.param, self.code))
        return web.Response(status=self.status, body=msgspec.json.encode(body), content_type="application/json",
                            headers=self.headers)


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"unknown field `(.+?)`")
_MISSING = re.compile(r"missing required field `(.+?)`")


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON body into `typ`; any problem is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg)
        path = m.group(1) if m else None
        for pattern in (_UNKNOWN, _MISSING):
            if f := pattern.search(msg):
                path = f"{path}.{f.group(1)}" if path else f.group(1)
        text = _PATH.sub("", msg)
        raise ApiError(400, f"{path}: {text}" if path else text, param=path) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        path = deep_path(body[:DEEP_SCAN_BYTES], MAX_JSON_DEPTH)
        where = f"{path}: nests" if path else "the request body nests"
        raise ApiError(400, f"{where} deeper than the limit of {MAX_JSON_DEPTH} levels", param=path) from None


DEEP_SCAN_BYTES = 1 << 16  # how far deep_path looks for the field (bounded work on a hostile body)
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"\s*:?|[\[\]{}]')


def deep_path(body: bytes, limit: int) -> str | None:
    """The field (its first three keys) where a JSON text first nests deeper than `limit`."""
    keys: list[str] = []  # the key each open level was opened under ("" in a list)
    pending = ""
    for m in _TOKEN.finditer(body):
        t = m.group()
        if t[0] == 34:  # a string; "key": names what opens next
            pending = t.rstrip(b" \t\r\n:")[1:-1].decode("utf-8", "replace") if t.endswith(b":") else ""
        elif t in (b"[", b"{"):
            keys.append(pending)
            pending = ""
            if len(keys) > limit:
                return ".".join([k for k in keys if k][:3]) or None
        elif keys:
            keys.pop()
    return None


def value_error(e: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """A refused request (InvalidParam, GrammarError) as a 400 whose `param` is the field it
    carries, in the API's names; a ValueError that names no field is a 400 without one."""
    field: str | None = getattr(e, "field", None)
    if field is None:
        return ApiError(400, str(e))
    rest = getattr(e, "message", str(e))
    rename = rename or {}
    name = rename.get(field, field)
    for old, new in rename.items():
        if "_" in old:  # parameter names in the text, e.g. max_new_tokens -> max_tokens
            rest = rest.replace(old, new)
    return ApiError(400, f"{name}: {rest}", param=name)


def prompt_batch(value: list[Any], param: str, texts_ok: bool) -> tuple[list[Any], bool]:
    """A list-valued prompt: token ids, a batch of token-id lists, or (texts_ok) a batch of
    strings. Returns the prompts and whether it was a batch."""
    if not value:
        raise ApiError(400, f"{param}: must not be empty", param=param)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [value], False
    if texts_ok and all(isinstance(x, str) for x in value):
        return list(value), True
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in value):
        return list(value), True
    kinds = "token ids, a list of token-id lists" + (", or a list of strings" if texts_ok else "")
    raise ApiError(400, f"{param}: expected {kinds}", param=param)
