"""Reading a request body, bounded: a declared length over --max-request-bytes is refused from
the header (413 before a byte of the body is read), a body that is not declared JSON
(Content-Type application/json or a +json type, any charset) is a 415, a body that does not
arrive within --body-read-timeout is a 408, and no JSON value nests deeper than MAX_JSON_DEPTH
(a 400 naming the field). Both 413 and 408 close the connection, so no unread body is drained.
A long body is decoded and checked off the event loop (OFF_LOOP_BYTES)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import msgspec
import msgspec.inspect as mi
from aiohttp import web

from radixserve.limits import MAX_JSON_DEPTH, too_deep
from radixserve.server import rate_limit
from radixserve.server.auth import TENANT_KEY
from radixserve.server.errors import ApiError, decode_body

OFF_LOOP_BYTES = 1 << 18  # a body longer than this is decoded and checked on a worker thread (tens of ms a MiB)


async def read_body(request: web.Request, typ: type) -> Any:
    config = request.app["state"].config
    declared = request.content_length
    if declared is not None and declared > config.max_request_bytes:
        raise too_large(config.max_request_bytes, declared)
    check_json_type(request)
    try:
        async with asyncio.timeout(config.body_read_timeout):  # no task: a body already here is read without a suspension
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within the body_read_timeout of {config.body_read_timeout:g} s",
                       code="body_timeout") from None
    if declared is None and (tenant := request.get(TENANT_KEY)) is not None:  # chunked: counted once read
        request.app["state"].rate_limiter.charge(tenant, rate_limit.units(len(raw)) - 1)
    if len(raw) > OFF_LOOP_BYTES:
        return await request.app["state"].off_loop(_decoded, raw, typ)
    return _decoded(raw, typ)


def _decoded(raw: bytes, typ: type) -> Any:
    body = decode_body(raw, typ)
    check_depth(body)
    return body


def check_json_type(request: web.Request) -> None:
    """A body's Content-Type must say JSON (as every OpenAI and Anthropic client sends it)."""
    kind = request.content_type  # the media type alone, lower case; no header: application/octet-stream
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    given = request.headers.get("Content-Type")
    got = "no Content-Type header" if given is None else f"{given[:100]!r}"
    raise ApiError(415, f"Content-Type: the body must be JSON, sent as 'Content-Type: application/json'; got {got}",
                   code="unsupported_media_type")


def too_large(limit: int, declared: int | None = None) -> ApiError:
    size = f" ({declared} bytes declared)" if declared is not None else ""
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes{size}", code="request_too_large")


def check_depth(value: Any) -> None:
    """Every free-form JSON field of a decoded body (schemas, tools, ...) within the nesting cap.
    Only the fields that can nest are walked (`_nesting_fields`), and the path is built only for
    the field that fails: a body of 20,000 content blocks is checked in a few milliseconds (it
    took 36 ms with a path string made for every field, under the GIL beside the event loop)."""
    bad = _too_deep(value)
    if bad is not None:
        where = "".join(part if part.startswith("[") else "." + part for part in bad).removeprefix(".")
        raise ApiError(400, f"{where}: nests deeper than the limit of {MAX_JSON_DEPTH} levels", param=where)


def _too_deep(value: Any) -> list[str] | None:
    """The path (field names and "[i]") to the first field nesting too deep, or None."""
    if isinstance(value, msgspec.Struct):
        for name in _nesting_fields(type(value)):
            if (bad := _too_deep(getattr(value, name))) is not None:
                return [name, *bad]
    elif isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
        for i, item in enumerate(value):
            if (bad := _too_deep(item)) is not None:
                return [f"[{i}]", *bad]
    elif isinstance(value, (dict, list)) and too_deep(value, MAX_JSON_DEPTH):
        return []
    return None


@functools.cache
def _nesting_fields(cls: type) -> tuple[str, ...]:
    """A Struct type's fields that may hold something that nests (a Struct, a list, a dict, any
    JSON); a scalar field never does."""
    return tuple(f.name for f in msgspec.inspect.type_info(cls).fields if _may_nest(f.type))  # type: ignore[attr-defined]


_SCALARS = (mi.StrType, mi.IntType, mi.FloatType, mi.BoolType, mi.NoneType, mi.LiteralType, mi.EnumType, mi.BytesType)


def _may_nest(t: mi.Type) -> bool:
    if isinstance(t, mi.UnionType):
        return any(_may_nest(x) for x in t.types)
    return not isinstance(t, _SCALARS)
