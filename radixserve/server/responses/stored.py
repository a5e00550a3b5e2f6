"""Stored responses over HTTP: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
and the store calls the create route makes. A tenant sees only its own responses: another
tenant's id gets the very 404 an id that never existed gets."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from radixserve.server.errors import ApiError
from radixserve.server.responses.protocol import DeletedResponse, InputItemList
from radixserve.server.responses.store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)
STORE = web.AppKey("responses_store", ResponseStore)
MAX_LIST_LIMIT = 100  # OpenAI's cap on one page of input items


def db_path(config: Any) -> Path:
    """--responses-db, else responses.sqlite3 in radixserve's cache folder (where converted
    models go)."""
    if getattr(config, "responses_db", None):
        return Path(config.responses_db).expanduser()
    from radixserve.models.gguf import cache_root  # its package imports torch: only once a response is stored

    return cache_root() / "responses.sqlite3"


async def db(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    """A store call, off the event loop; a store that fails says so (and is logged)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(request.app["state"].executor, fn, *args)
    except (sqlite3.Error, OSError) as e:
        log.exception("the response store failed")
        raise ApiError(500, f"the response store failed: {e}", code="store_error") from None


def not_found(rid: str, param: str) -> ApiError:
    """The same answer for an id that does not exist and one another tenant owns."""
    return ApiError(404, f"{param}: no response {rid!r} was found", param=param, code="not_found")


async def _stored(request: web.Request) -> StoredResponse:
    tenant = request.app["state"].auth.of_request(request)
    rid = request.match_info["response_id"]
    row = await db(request, request.app[STORE].get, tenant.owner, rid)
    if row is None:
        raise not_found(rid, "response_id")
    return row


async def retrieve(request: web.Request) -> web.Response:
    row = await _stored(request)
    return web.Response(body=row.response, content_type="application/json")


async def delete(request: web.Request) -> web.Response:
    tenant = request.app["state"].auth.of_request(request)
    rid = request.match_info["response_id"]
    if not await db(request, request.app[STORE].delete, tenant.owner, rid):
        raise not_found(rid, "response_id")
    return web.Response(body=msgspec.json.encode(DeletedResponse(rid)), content_type="application/json")


async def input_items(request: web.Request) -> web.Response:
    """One page of a stored response's own input items: `limit` (1-100, default 20), `order`
    (asc | desc, default desc, as OpenAI), `after` (an item id)."""
    limit, order, after = _page(request.query)
    row = await _stored(request)
    items = msgspec.json.decode(row.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it.get("id") for it in items]
        if after not in ids:
            raise ApiError(400, f"after: response {row.id!r} has no input item {after!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    body = InputItemList(page, page[0]["id"] if page else None, page[-1]["id"] if page else None, len(items) > limit)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def _page(query: Any) -> tuple[int, str, str | None]:
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ApiError(400, f"limit: expected an integer in [1, {MAX_LIST_LIMIT}], got {query.get('limit')!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: {order!r} is not one of asc, desc", param="order")
    return limit, order, query.get("after")


async def close(app: web.Application) -> None:
    app[STORE].close()


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore(lambda: db_path(app["state"].config),  # opened at first use
                               lambda: app["state"].config.responses_max_stored)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.on_cleanup.append(close)
