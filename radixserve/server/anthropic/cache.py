"""Anthropic's prompt caching: `cache_control` breakpoints, their TTLs, and the usage fields.

A breakpoint (`{"type": "ephemeral", "ttl": "5m" | "1h"}` on a tool, a system block or a message
content block, or on the request itself: its whole prompt) asks for the prompt up to the end of
that block to stay cached for its TTL. Where that is in tokens depends on the chat template, so
it is measured: the request cut just after the block is rendered with the same template (a
placeholder user turn where the cut leaves none), and the breakpoint is the number of leading
tokens it shares with the full prompt. The marks are counted in one pass that copies nothing
(a 5th, or a TTL past the tenant's max_cache_retention, is a 400 naming its field); the cuts
are made at admission, off the event loop, one at a time.

The prefix cache caches every prompt anyway; a breakpoint adds retention (request.Retention:
its prefix stays on the disk tier until the TTL ends, and is evicted from the pool after
unretained prefixes) and the usage split Anthropic reports:

    cache_read_input_tokens      prompt tokens served from the cache (any tier)
    cache_creation_input_tokens  tokens up to the last breakpoint that were not (now written),
                                 split by TTL in cache_creation (up to the last 1h breakpoint: 1h)
    input_tokens                 the rest: prompt - read - creation
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from msgspec import structs

from radixserve.cache.prefix import common_prefix_len
from radixserve.engine.outputs import Output
from radixserve.request import Retention
from radixserve.server.anthropic.protocol import CacheCreation, MessageParam, MessagesRequest, ToolChoice, Usage
from radixserve.server.chat import core as chat_core
from radixserve.server.errors import ApiError
from radixserve.server.state import RequestOptions

log = logging.getLogger(__name__)

TTLS = {"5m": 300, "1h": 3600}
MAX_BREAKPOINTS = 4  # as Anthropic's API
PLACEHOLDER = "\u2063"  # the user turn a cut before the messages renders: shares no token with a real one


@dataclass(frozen=True)
class Mark:
    """One cache_control: the field that holds it, its TTL (s), and where its cut ends: after
    tools[i], after system[i], after messages[i].content[j], or the whole request."""

    where: str
    ttl: int
    kind: str  # tools | system | messages | request
    i: int = 0
    j: int = 0


@dataclass
class Breakpoints:
    marks: list[Mark] = field(default_factory=list)  # in prompt order, at most MAX_BREAKPOINTS
    request: MessagesRequest | None = None  # what they mark
    points: list[tuple[int, int]] = field(default_factory=list)  # (tokens through it, TTL s), once rendered

    def usage(self, out: Output) -> Usage:
        read = out.cached_tokens
        last = max((p for p, _ in self.points), default=0)
        hour = max((p for p, t in self.points if t == TTLS["1h"]), default=0)
        long = max(hour - read, 0)
        short = max(last - max(read, hour), 0)
        return Usage(out.prompt_tokens - read - long - short, out.completion_tokens, read, long + short,
                     CacheCreation(short, long))

    def cuts(self) -> Iterator[tuple[MessagesRequest, int]]:
        """Each breakpoint's cut of the request (the request up to its block) and TTL, one at a
        time: a cut shares the request's blocks and lists only references to them."""
        b = self.request
        if b is None:
            return
        choice = b.tool_choice
        if choice is not None and choice.type in ("any", "tool"):  # a cut may lose the named tool: render as auto
            choice = ToolChoice("auto")
        base = structs.replace(b, tool_choice=choice, output_config=None)
        placeholder = [MessageParam("user", PLACEHOLDER)]
        for m in self.marks:
            if m.kind == "tools":
                yield structs.replace(base, tools=(b.tools or [])[: m.i + 1], messages=placeholder), m.ttl
            elif m.kind == "system":
                assert isinstance(b.system, list)
                yield structs.replace(base, system=b.system[: m.i + 1], messages=placeholder), m.ttl
            elif m.kind == "messages":
                msg = b.messages[m.i]
                cut = structs.replace(msg, content=msg.content[: m.j + 1])
                yield structs.replace(base, messages=[*b.messages[: m.i], cut]), m.ttl
            else:
                yield base, m.ttl


def _ttl(cc: Any, where: str) -> int:
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise ApiError(400, f"{where}.type: must be \"ephemeral\"", param=f"{where}.type")
    if set(cc) - {"type", "ttl"}:
        extra = sorted(set(cc) - {"type", "ttl"})[0]
        raise ApiError(400, f"{where}.{extra}: extra inputs are not permitted", param=f"{where}.{extra}")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS:
        raise ApiError(400, f"{where}.ttl: {ttl!r} is not one of '5m', '1h'", param=f"{where}.ttl")
    return TTLS[ttl]


def _marked(b: MessagesRequest) -> Iterator[tuple[Any, str, str, int, int]]:
    """Every cache_control of the request, in prompt order: (it, its field, kind, i, j)."""
    for i, t in enumerate(b.tools or []):
        if t.cache_control is not None:
            yield t.cache_control, f"tools[{i}].cache_control", "tools", i, 0
    if isinstance(b.system, list):
        for i, blk in enumerate(b.system):
            if blk.cache_control is not None:
                yield blk.cache_control, f"system[{i}].cache_control", "system", i, 0
    for i, m in enumerate(b.messages):
        if not isinstance(m.content, str):
            for j, part in enumerate(m.content):
                if (cc := getattr(part, "cache_control", None)) is not None:
                    yield cc, f"messages[{i}].content[{j}].cache_control", "messages", i, j
    if b.cache_control is not None:
        yield b.cache_control, "cache_control", "request", 0, 0


def find(b: MessagesRequest, max_ttl: int | None = None) -> Breakpoints:
    """The request's breakpoints, in prompt order (a 400 naming the field for a bad one, for a
    5th, or for a TTL past `max_ttl` seconds: the tenant's max_cache_retention). One pass that
    stops at the first refusal and copies nothing: the cuts are made one at a time, later."""
    marks: list[Mark] = []
    for cc, where, kind, i, j in _marked(b):
        if len(marks) == MAX_BREAKPOINTS:
            raise ApiError(400, f"{where}: a request may mark at most {MAX_BREAKPOINTS} blocks with cache_control, "
                                f"this is the {MAX_BREAKPOINTS + 1}th", param=where)
        ttl = _ttl(cc, where)
        if max_ttl is not None and ttl > max_ttl:
            raise ApiError(400, f"{where}.ttl: this tenant may keep a prompt cached for at most {max_ttl} s, the ttl asks "
                                f"{ttl} s (the server's tenants file sets max_cache_retention)",
                           param=f"{where}.ttl", code="retention_not_allowed")
        marks.append(Mark(where, ttl, kind, i, j))
    return Breakpoints(marks, b)


def renderer(state: Any, render: Callable[[], list[int]], marks: Breakpoints, opts: RequestOptions,
             plan_of: Callable[[MessagesRequest], chat_core.Plan], rename: dict[str, str]) -> Callable[[], list[int]]:
    """`render` (the prompt's ids), then each breakpoint's position in them; sets the request's
    retention: its longest TTL over the prompt up to its last breakpoint.

    NOTE: runs off the loop at admission, before the request is built from `opts` (ServerState
    admit renders each prompt, then builds its request): so `opts.retention` set here is used."""

    def run() -> list[int]:
        ids = render()
        for cut, ttl in marks.cuts():
            try:
                cut_ids = chat_core.renderer(state.engine, plan_of(cut), rename)()
            except Exception as e:  # a cut the template cannot render: that breakpoint marks nothing
                log.debug("cache_control: a cut of the request did not render (%r)", e)
                continue
            marks.points.append((common_prefix_len(ids, cut_ids), ttl))
        last = max((p for p, _ in marks.points), default=0)
        if last:
            opts.retention = Retention(max(t for _, t in marks.points), last)
        return ids

    return run
