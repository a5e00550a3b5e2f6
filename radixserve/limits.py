"""Caps on what one request may ask for, in one place. Each keeps a request's cost (memory, and
work on the engine thread at every step) bounded by what a real caller needs; over a cap is
a 400 naming the field and the cap, decided before any engine work."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # nesting of any JSON value: a body's fields, schemas, tool parameters, structural tags
MAX_STOPS = 16  # stop strings are checked against the output's tail at every token
MAX_STOP_CHARS = 2048
MAX_STOP_TOKEN_IDS = 1024
MAX_CACHE_SALT_CHARS = 256  # the prefix-cache namespace is (tenant, cache_salt)
MAX_RID_CHARS = 256
MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's own cap
MAX_N = 64  # samples of one prompt (OpenAI's n, SGLang's sampling_params.n)
MAX_METADATA_KEYS = 16  # OpenAI's own cap


class TooDeep(ValueError):
    """A JSON value nests more than MAX_JSON_DEPTH levels."""


def loads(text: str) -> Any:
    """json.loads under the nesting cap: TooDeep past it (also where json's own recursion gives
    up), json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nests deeper than the limit of {MAX_JSON_DEPTH} levels") from None
    if too_deep(value):
        raise TooDeep(f"nests deeper than the limit of {MAX_JSON_DEPTH} levels")
    return value


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a decoded JSON value (dicts and lists) nests more than `limit` levels. Iterative:
    no recursion limit to hit, and it stops at the first path that is too deep."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False
