"""The next turn's prefix, computed before it comes (`--precompute-history`, on by default).

A reasoning model's chat template drops an earlier turn's reasoning (Qwen3 strips `<think>`,
DeepSeek-R1 likewise, gpt-oss's harmony its analysis channel), so the next turn's prompt
leaves the cached one where the last answer began: the answer and everything after it would be
computed again on every turn. Once a chat answer ends, the server renders the conversation
as the next request will: the messages, the answer as the client sends it back (its content,
its calls in the history form; the reasoning gone), and the next message's opening (a user's,
or a tool's after calls), up to where that message's text would start. It computes that
prefix's KV into the radix tree as a request of its own: no output, the lowest priority (it
never goes before a waiting request), in the asking tenant's namespace, at most
MAX_IN_FLIGHT at a time and only while nothing waits. The returning turn then finds its whole
history cached and computes only its new message. Where the history form begins with the turn
as it ran (its prompt and its answer's tokens, which the cache holds: a template that keeps
the answer as written, re-tokenized the same), there is nothing to compute ahead and nothing
runs: only the rendering, on a thread.

Counted in /metrics (radixserve_history_*: tokens precomputed, turns that hit a precomputed
history and the tokens the hits saved) and /server_info's `history`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from array import array
from collections import OrderedDict, deque
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.engine.outputs import Output
from radixserve.request import BACKGROUND, SamplingParams
from radixserve.server.chat import reasoning, tools

if TYPE_CHECKING:
    from radixserve.server.auth import Tenant
    from radixserve.server.chat.core import Plan, Turn
    from radixserve.server.state import Flight, RequestOptions, ServerState

log = logging.getLogger(__name__)

SENTINEL = "RADIXSERVE_NEXT_TURN_8d2f"  # the next message's text: the history form ends where it starts
MAX_IN_FLIGHT = 2
RECENT = 8  # precomputed histories remembered per namespace, to count the hits they give
MAX_NAMESPACES = 1024  # ... in the namespaces of the latest precomputes


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


@dataclass
class _Warmed:
    n: int  # tokens of the history form
    digest: bytes  # a hash of them
    computed: int  # of them, those the precompute computed (the rest was cached)


@dataclass
class HistoryCounters:
    precomputes: int = 0  # histories computed
    skipped: int = 0  # not computed: requests waited, or MAX_IN_FLIGHT ran
    in_cache: int = 0  # nothing to compute: the history form begins with the turn as it ran
    failed: int = 0
    precomputed_tokens: int = 0
    hits: int = 0  # returning turns whose prompt began with a precomputed history, still cached
    hit_tokens: int = 0  # of their cached tokens, those the precomputes computed


HISTORY_HELP = {
    "precomputes": "conversations whose next turn's prefix was computed after an answer",
    "skipped": "answers whose history was not precomputed: requests waited, or enough precomputes ran",
    "in_cache": "answers whose history form begins with the turn as it ran (cached already: nothing to precompute)",
    "failed": "history precomputes that failed",
    "precomputed_tokens": "prompt tokens the history precomputes computed",
    "hits": "returning turns that found their precomputed history cached",
    "hit_tokens": "of those turns' cached tokens, the ones their history precomputes computed",
}


class HistoryWarmer:
    """One per server (ServerState.history)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.enabled = state.config.precompute_history
        self.running = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.recent: OrderedDict[tuple[str | None, str | None], deque[_Warmed]] = OrderedDict()  # LRU, MAX_NAMESPACES
        self.counters = HistoryCounters()

    def after_turn(self, tenant: Tenant, turn: Turn, flight: Flight) -> None:
        """A chat reply is complete: count a hit it got, and compute its history form (in the
        background) where it ended whole with one choice. Not for a Responses turn (`rendered`:
        a stored one's next turn continues the text as the model wrote it, which the cache
        holds already), a stored turn's continuation (`prefix`) nor a prefilled answer."""
        if not self.enabled or len(flight.tickets) != 1 or not flight.reqs or self.state.admission.draining:
            return
        out, req = flight.tickets[0].out, flight.reqs[0]
        if out is None or out.finish_reason not in ("stop", "length"):
            return
        warm = not (turn.plan.prefill or turn.prefix is not None or turn.rendered is not None)
        if warm and (self.running >= MAX_IN_FLIGHT or self.state.engine.snapshot().waiting):
            self.counters.skipped += 1
            warm = False
        task = asyncio.ensure_future(self._after(tenant, turn.plan, req.token_ids, out, turn.options, warm))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if warm:  # (counted at once: a burst of answers starts at most MAX_IN_FLIGHT; until the task ends, run or not)
            self.running += 1
            task.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Task[None]) -> None:
        self.running -= 1

    async def _after(self, tenant: Tenant, plan: Plan, prompt: list[int], out: Output, opts: RequestOptions,
                     warm: bool) -> None:
        ns = (tenant.namespace_key, opts.cache_salt)
        self._count_hit(ns, prompt, out.cached_tokens)
        if not warm:
            return
        try:
            ids = await self.state.off_loop(self._history_ids, plan, out, prompt)
            if ids == []:
                self.counters.in_cache += 1
                return
            if ids is None or len(ids) <= out.prompt_tokens // 2 or len(ids) >= self.state.engine.context_len:
                self.counters.skipped += 1  # (a template that renders no history; a conversation at the window's end)
                return
            done = await self._compute(tenant, prompt, ids, opts)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.counters.failed += 1
            log.exception("precomputing a conversation's history failed")
            return
        if done is None:
            return
        computed = done.prompt_tokens - done.cached_tokens
        self.counters.precomputes += 1
        self.counters.precomputed_tokens += computed
        kept = self.recent.setdefault(ns, deque(maxlen=RECENT))
        self.recent.move_to_end(ns)
        kept.append(_Warmed(len(ids), _digest(ids), computed))
        while len(self.recent) > MAX_NAMESPACES:
            self.recent.popitem(last=False)

    def _count_hit(self, ns: tuple[str | None, str | None], prompt: list[int], cached: int) -> None:
        """A precomputed history this prompt starts with (each is used once): a hit where the
        request found its precomputed part cached. On the event loop: a few hashes of prompt
        prefixes (at most RECENT)."""
        kept = self.recent.get(ns)
        for w in list(kept or ()):
            if len(prompt) > w.n and _digest(prompt[:w.n]) == w.digest:
                assert kept is not None
                kept.remove(w)
                if not kept:
                    del self.recent[ns]
                saved = min(cached, w.n) - (w.n - w.computed)
                if saved > 0:
                    self.counters.hits += 1
                    self.counters.hit_tokens += saved
                return

    def _history_ids(self, plan: Plan, out: Output, prompt: list[int]) -> list[int] | None:
        """The conversation with this answer, as the next request will render it, up to where
        the next message's text starts (None: the template does not render it so; empty: it
        begins with the prompt and the answer's tokens, all but the last of which the cache
        holds, so the next turn would compute no more of it than the precompute would)."""
        a = reasoning.answer(out.text, out.finish_reason, plan.parser, plan.mode, plan.offered, plan.tool_format,
                             plan.one_call)
        calls = [{"function": {"name": c.function.name, "arguments": c.function.arguments}} for c in a.calls]
        content = "\n".join(x for x in (a.content or "", tools.history_text(calls, "tool_calls")) if x)
        after = {"role": "tool" if calls else "user", "content": SENTINEL}
        engine = self.state.engine
        messages, specs = tools.render([*plan.messages, {"role": "assistant", "content": content}, after], plan.offered,
                                       getattr(engine.tokenizer, "chat_template", None))
        ids = engine.turn_prefix_ids(messages, specs, plan.template_kwargs or None, SENTINEL)
        ran = len(prompt) + len(out.token_ids)
        if ids is not None and len(ids) >= ran and ids[:len(prompt)] == prompt and ids[len(prompt):ran] == out.token_ids:
            return []
        return ids

    async def _compute(self, tenant: Tenant, prompt: list[int], ids: list[int], opts: RequestOptions) -> Output | None:
        engine = self.state.engine
        public = None  # the public prefix the request shared, never more: the answer after it is the tenant's own
        if opts.public_prefix_len:
            same = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
            public = min(opts.public_prefix_len, same)
        req = engine.make_req(ids, SamplingParams(max_new_tokens=0), None, BACKGROUND, tenant=tenant.id,
                              cache_salt=opts.cache_salt, public_prefix_len=public, retention=opts.retention,
                              tenant_key=tenant.namespace_key, lora=opts.lora)  # an adapter's history: in its namespace
        engine.route(req)  # data-parallel: by its prefix, to the replica that holds the conversation
        final = None
        async with aclosing(engine.submit(req)) as deltas:
            async for d in deltas:
                final = d.output if d.finished else final
        return final if final is not None and final.finish_reason not in ("error", "abort") else None

    def info(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "running": self.running, **vars(self.counters)}

    def stop(self) -> None:
        """The server drains: what is being precomputed is dropped."""
        for task in list(self.tasks):
            task.cancel()
