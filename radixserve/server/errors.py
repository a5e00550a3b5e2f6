"""API errors: one exception type, rendered as OpenAI-style JSON `{"error": {...}}`."""

from __future__ import annotations

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
    415: "invalid_request_error",
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

    def body(self) -> ErrorResponse:
        """`{"error": {...}}`: the reply's body, and an OpenAI stream's last chunk when it fails."""
        return ErrorResponse(ErrorDetail(self.message, ERROR_TYPES.get(self.status, "error"), self.param, self.code))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()), content_type="application/json",
                            headers=self.headers)


_AT = " - at `$"  # msgspec ends a message with the path it failed at: " - at `$.a[0].b`"


def _path(msg: str) -> tuple[str | None, str]:
    """The path msgspec names at the end of its message, and the message without it. NOTE: the
    message may hold the client's own key (an unknown field): read with str.find, linear
    whatever the key (a backtracking regex was quadratic on a key of " - at `$"s and a newline),
    and a path is only field names and indexes."""
    at = msg.rfind(_AT) if msg.endswith("`") else -1
    path = msg[at + len(_AT):-1]
    if at < 0 or not all(c.isalnum() or c in "_.[]" for c in path):
        return None, msg
    return path.removeprefix("."), msg[:at]


def _quoted(msg: str, lead: str) -> str | None:
    """The field msgspec quotes after `lead` ("unknown field `x`")."""
    at = msg.find(lead)
    end = msg.find("`", at + len(lead)) if at >= 0 else -1
    return msg[at + len(lead):end] if end > at + len(lead) else None


def decode_body(body: bytes, typ: type) -> Any:
    """Decode a JSON body into `typ`; any problem is a 400 naming the field."""
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        path, text = _path(str(e))
        for lead in ("unknown field `", "missing required field `"):
            if (f := _quoted(text, lead)) is not None:
                path = f"{path}.{f}" if path else f
        raise ApiError(400, f"{path}: {text}" if path else text, param=path) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        path = deep_path(body[:DEEP_SCAN_BYTES], MAX_JSON_DEPTH)
        where = f"{path}: nests" if path else "the request body nests"
        raise ApiError(400, f"{where} deeper than the limit of {MAX_JSON_DEPTH} levels", param=path) from None


DEEP_SCAN_BYTES = 1 << 16  # how far deep_path looks for the field (bounded work on a hostile body)
_MARKS = bytes.maketrans(b"[]{}", b'""""')  # each bracket as a quote: the next mark is one bytes.find


def deep_path(body: bytes, limit: int) -> str | None:
    """The field (its first three keys) where a JSON text first nests deeper than `limit`. One
    pass: each string is skipped once (one not closed ends the scan), each bracket counted."""
    keys: list[str] = []  # the key each open level was opened under ("" in a list)
    pending, i, marks = "", 0, body.translate(_MARKS)
    while (at := marks.find(b'"', i)) >= 0:
        if body[at] == 34:  # a string; "key": names what opens next
            end = _string_end(body, at + 1)
            if end < 0:
                return None
            i = end + 1
            while i < len(body) and body[i] in b" \t\r\n":  # (each byte once: the scan only moves on)
                i += 1
            pending = body[at + 1:end].decode("utf-8", "replace") if body.startswith(b":", i) else ""
            continue
        i = at + 1
        if body[at] in b"[{":
            keys.append(pending)
            pending = ""
            if len(keys) > limit:
                return ".".join([k for k in keys if k][:3]) or None
        elif keys:
            keys.pop()
    return None


def _string_end(body: bytes, i: int) -> int:
    """The closing quote of the JSON string whose text starts at `i` (-1: not closed)."""
    while (q := body.find(b'"', i)) >= 0:
        if (q - i - len(body[i:q].rstrip(b"\\"))) % 2 == 0:  # not escaped: an even run of backslashes before it
            return q
        i = q + 1
    return -1


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
