"""What the ingress hands a replica (an HTTP request as it came, plus its routing key) and what
a replica streams back (a `Head`, then the body's bytes). Pure Python: no ray, no aiohttp.

The routing key is read from the JSON body without validating it (the replica's server does,
and answers a bad body with its own 4xx, passed back unchanged):

- namespace: (a keyed digest of the API key, cache_salt, model): the server's cache namespace is
  (tenant, cache_salt), and a tenant is one API key (the key itself never leaves the ingress);
  a LoRA adapter's KV is its own (the request's `model` names it), so prefixes are keyed by the
  model named too (a client that names the base model and one that leaves `model` out are
  routed apart: affinity only, nothing cached is shared wrongly either way).
- prefix: the prompt's start as one canonical string, stable fields first (system,
  instructions, tools) and then the growing ones (messages, input, prompt, text), one element
  after another, so turn 2 of a conversation extends turn 1's string; token ids (`input_ids`,
  a token-id `prompt`) stay token ids.
- hint: OpenAI's `prompt_cache_key`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from radixserve.routing import RouteKey

Headers = tuple[tuple[str, str], ...]
SEP = "\x1e"  # between the parts of the canonical prompt string
STABLE_FIELDS = ("system", "instructions", "tools")  # before the fields a conversation grows
GROWING_FIELDS = ("messages", "input", "prompt", "text", "input_ids")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade"})
REQUEST_FRAMING = HOP_BY_HOP | {"host", "content-length"}  # a proxied request gets its own
RESPONSE_OWN = HOP_BY_HOP | {"date", "server"}  # the Ray proxy sends its own
_DIGEST_KEY = os.urandom(16)  # per process: the digest names a key for this router only


@dataclass(frozen=True)
class Envelope:
    method: str
    path: str  # with its query string
    headers: Headers
    body: bytes
    key: RouteKey | None  # None (no JSON body): Ray's own choice, the least loaded replica
    avoid: frozenset[str] = field(default_factory=frozenset)  # replicas (unique ids) this request already failed on

    def avoiding(self, replica: str | None) -> Envelope:
        return replace(self, avoid=self.avoid | {replica}) if replica else self


@dataclass(frozen=True)
class Head:
    """A replica's first stream item: its server's status line and headers."""

    status: int
    headers: Headers
    replica: str  # the replica's unique id (also sent to the client as x-radixserve-replica)


def end_to_end(headers: Mapping[str, str] | Headers, drop: frozenset[str] = HOP_BY_HOP) -> Headers:
    """The headers a proxy passes on: all but the hop-by-hop ones (and `drop`)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    return tuple((k, v) for k, v in items if k.lower() not in drop)


def route_key(headers: Headers, body: bytes) -> RouteKey | None:
    """The routing key of a JSON request body; None when the body is not a JSON object."""
    if not body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    salt, hint, model = doc.get("cache_salt"), doc.get("prompt_cache_key"), doc.get("model")
    namespace = (key_digest(headers), salt if isinstance(salt, str) else None, model if isinstance(model, str) and model else None)
    return RouteKey(namespace, prompt_prefix(doc), hint if isinstance(hint, str) else None)


def key_digest(headers: Headers) -> str | None:
    """A digest of the API key the request sends (Authorization: Bearer, else x-api-key)."""
    found = {k.lower(): v for k, v in headers if k.lower() in ("authorization", "x-api-key")}
    auth, key = found.get("authorization"), found.get("x-api-key")
    if auth and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    if not key:
        return None
    return hashlib.blake2b(key.encode("utf-8", "surrogateescape"), key=_DIGEST_KEY, digest_size=16).hexdigest()


def prompt_prefix(doc: Mapping[str, Any]) -> str | list[int]:
    """The canonical prompt string (or the token ids) of a request body."""
    for name in ("input_ids", "prompt"):
        ids = _token_ids(doc.get(name))
        if ids is not None:
            return ids
    parts: list[str] = []
    for name in (*STABLE_FIELDS, *GROWING_FIELDS):
        value = doc.get(name)
        if value is not None and name != "input_ids":
            parts.append(name + SEP + _render(value))
    return "".join(parts)


def _token_ids(value: Any) -> list[int] | None:
    """Token ids, or the first prompt of a batch of them."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _render(value: Any) -> str:
    """Text as it is; a list element by element (so a longer list extends a shorter one's
    string); a message as its role and content; anything else as compact JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_render(v) + SEP for v in value)
    if isinstance(value, dict) and "content" in value:
        rest = {k: v for k, v in value.items() if k not in ("role", "content")}
        tail = json.dumps(rest, separators=(",", ":"), ensure_ascii=False) if rest else ""
        return f"{value.get('role', '')}{SEP}{_render(value['content'])}{tail}"
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
