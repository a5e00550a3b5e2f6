"""Anthropic's prompt caching: `cache_control` breakpoints, their TTLs, and the usage fields.

A breakpoint (`{"type": "ephemeral", "ttl": "5m" | "1h"}` on a tool, a system block or a message
content block, or on the request itself: its whole prompt) asks for the prompt up to the end of
that block to stay cached for its TTL. Where that is in tokens depends on the chat template, so
it is measured: the request cut just after the block is rendered with the same template (a
placeholder user turn where the cut leaves none), and the breakpoint is the number of leading
tokens it shares with the full prompt.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msgspec import structs

from radixserve.cache.prefix import common_prefix_len
from radixserve.engine.outputs import Output
from radixserve.request import Retention
from radixserve.server import chat_core
from radixserve.server.anthropic_protocol import CacheCreation, MessageParam, MessagesRequest, ToolChoice, Usage
from radixserve.server.errors import ApiError
from radixserve.server.state import RequestOptions

log = logging.getLogger(__name__)

TTLS = {"5m": 300, "1h": 3600}
MAX_BREAKPOINTS = 4  # as Anthropic's API
PLACEHOLDER = "\u2063"  # the user turn a cut before the messages renders: shares no token with a real one


@dataclass
class Breakpoints:
    cuts: list[tuple[MessagesRequest, int]]  # the request cut after each marked block, and its TTL (s)
    points: list[tuple[int, int]] = field(default_factory=list)  # (tokens through it, TTL s), once rendered

    def usage(self, out: Output) -> Usage:
        read = out.cached_tokens
        last = max((p for p, _ in self.points), default=0)
        hour = max((p for p, t in self.points if t == TTLS["1h"]), default=0)
        long = max(hour - read, 0)
        short = max(last - max(read, hour), 0)
        return Usage(out.prompt_tokens - read - long - short, out.completion_tokens, read, long + short,
                     CacheCreation(short, long))


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


def find(b: MessagesRequest) -> Breakpoints:
    """The request's breakpoints, in prompt order (400 naming the field for a bad one)."""
    cuts: list[tuple[MessagesRequest, int]] = []
    choice = b.tool_choice
    if choice is not None and choice.type in ("any", "tool"):  # a cut may lose the named tool: render as auto
        choice = ToolChoice("auto")
    base = structs.replace(b, tool_choice=choice, output_config=None)
    placeholder = [MessageParam("user", PLACEHOLDER)]
    for i, t in enumerate(b.tools or []):
        if t.cache_control is not None:
            ttl = _ttl(t.cache_control, f"tools[{i}].cache_control")
            cuts.append((structs.replace(base, tools=(b.tools or [])[: i + 1], messages=placeholder), ttl))
    if isinstance(b.system, list):
        for j, blk in enumerate(b.system):
            if blk.cache_control is not None:
                ttl = _ttl(blk.cache_control, f"system[{j}].cache_control")
                cuts.append((structs.replace(base, system=b.system[: j + 1], messages=placeholder), ttl))
    for i, m in enumerate(b.messages):
        if isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            cc = getattr(part, "cache_control", None)
            if cc is not None:
                ttl = _ttl(cc, f"messages[{i}].content[{j}].cache_control")
                cut = structs.replace(m, content=m.content[: j + 1])
                cuts.append((structs.replace(base, messages=[*b.messages[:i], cut]), ttl))
    if b.cache_control is not None:
        cuts.append((base, _ttl(b.cache_control, "cache_control")))
    if len(cuts) > MAX_BREAKPOINTS:
        raise ApiError(400, f"cache_control: a request may mark at most {MAX_BREAKPOINTS} blocks, this one marks {len(cuts)}",
                       param="cache_control")
    return Breakpoints(cuts)


def renderer(state: Any, render: Callable[[], list[int]], marks: Breakpoints, opts: RequestOptions,
             plan_of: Callable[[MessagesRequest], chat_core.Plan], rename: dict[str, str]) -> Callable[[], list[int]]:
    """`render` (the prompt's ids), then each breakpoint's position in them; sets the request's
    retention: its longest TTL over the prompt up to its last breakpoint.

    NOTE: runs off the loop at admission, before the request is built from `opts` (ServerState
    admit renders each prompt, then builds its request): so `opts.retention` set here is used."""

    def run() -> list[int]:
        ids = render()
        for cut, ttl in marks.cuts:
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
