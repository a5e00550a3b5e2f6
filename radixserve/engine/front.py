"""Request building, on whichever side of the engine boundary the caller is: tokenize, render
chat templates, validate, and resolve defaults into a Req (a plain AddRequest on the wire).

Shared by `Engine` (in-process) and `EngineProcess` (the front of an engine in its own process),
so both refuse the same input with the same InvalidParam.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from typing import Any

from radixserve.cache.prefix import salt_key
from radixserve.engine.outputs import Delta
from radixserve.engine.protocol import InvalidParam
from radixserve.limits import MAX_CACHE_SALT_CHARS
from radixserve.request import Req, Retention, SamplingParams
from radixserve.sched.policy import check_admissible

Prompt = str | list[int]


ON_STALL: ContextVar[Callable[[], None] | None] = ContextVar("radixserve_on_stall", default=None)
"""What else to do when a stream created in this context is cut off for its backlog: the HTTP
server drops the connection, whose writes are blocked on a client that reads nothing (its
handler then leaves at once instead of at the write timeout)."""


class DeltaStream:
    """One request's deltas, handed from the engine's side (any thread: `sink`) to the event
    loop that creates it. With `max_backlog`, a consumer that lets more deltas than that pile up
    unread (a client that stopped reading) has the request aborted (`abort`, once, then
    ON_STALL's hook): the deltas past the cap are dropped, and the final one still arrives, its
    error saying why."""

    def __init__(self, abort: Callable[[], None], max_backlog: int | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._q: asyncio.Queue[Delta] = asyncio.Queue()
        self._abort, self.max_backlog = abort, max_backlog
        self._on_stall = ON_STALL.get()
        self._stalled: str | None = None

    def sink(self, d: Delta) -> None:
        self._loop.call_soon_threadsafe(self._put, d)

    def _put(self, d: Delta) -> None:  # on the event loop
        if self.max_backlog is not None and self._q.qsize() >= self.max_backlog and not d.finished:
            if self._stalled is None:
                self._stalled = f"the client left {self._q.qsize()} stream chunks unread"
                self._abort()
                if self._on_stall is not None:
                    self._on_stall()
            return
        self._q.put_nowait(d)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Until the final delta; leaving early aborts the request."""
        finished = False
        try:
            while not finished:
                d = await self._q.get()
                finished = d.finished
                if finished and self._stalled and d.output is not None and d.output.error is None:
                    d.output.error = self._stalled
                yield d
        finally:
            if not finished:
                self._abort()


class RequestFront:
    """Needs: tokenizer, context_len, vocab_size (the tokenizer's), model_vocab_size (the
    model's rows), num_slots (the KV pool) and default_max_new_tokens."""

    tokenizer: Any
    context_len: int
    vocab_size: int
    model_vocab_size: int
    num_slots: int
    default_max_new_tokens: int
    _max_token_chars: int | None = None  # the longest vocabulary entry, once needed

    def make_req(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        rid: str | None = None,
        priority: int = 0,
        *,
        tenant: str | None = None,
        cache_salt: str | None = None,
        public_prefix_len: int | None = None,
        retention: Retention | None = None,
        tenant_key: str | None = None,
        default_max_new_tokens: int | None = None,
        lora: str | None = None,
    ) -> Req:
        """Tokenize and validate; raises InvalidParam (a ValueError) naming the bad field.

        The prefix-cache namespace is (tenant, a digest of cache_salt and `tenant_key`, the
        tenant's credential digest: cache.prefix.salt_key): requests share cached prefixes only
        within one. `public_prefix_len=k` opts in to the shared public namespace for the first k
        prompt tokens (hit by, and offered to, every request that opts in too). `retention`: how
        long its prompt should stay cached (request.Retention). Without params.max_new_tokens it
        generates up to `default_max_new_tokens` (None: the engine's default), at most what the
        context window and the KV pool leave after its prompt."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParam("prompt", "the prompt is empty")
            self._check_text_fits(len(prompt))
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.model_vocab_size:
                    raise InvalidParam("input_ids", f"{t!r} is not a token id in [0, {self.model_vocab_size})")
        params.validate(self.vocab_size)
        _check_namespace(tenant, cache_salt, public_prefix_len, len(ids))
        if tenant_key is not None and (not isinstance(tenant_key, str) or not tenant_key):
            raise InvalidParam("tenant_key", f"expected a non-empty string or None, got {tenant_key!r}")
        default = self.default_max_new_tokens if default_max_new_tokens is None else default_max_new_tokens
        default_max = max(min(default, self.context_len - len(ids), self.num_slots - len(ids)), 0)
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise InvalidParam("model", f"an adapter's name must be a non-empty string, got {lora!r}")
        req = Req(ids, params, rid=rid, priority=priority, max_new_tokens=default_max, tenant=tenant,
                  cache_salt=salt_key(cache_salt, tenant_key), public_prefix_len=public_prefix_len or 0,
                  retention=retention, lora=lora)
        check_admissible(req, self.context_len, self.num_slots)
        return req

    def describe(self) -> dict[str, Any] | None:
        """The replicas behind this front, for /server_info (one engine: None)."""
        return None

    def route(self, req: Req, hint: str | None = None) -> None:
        """Choose where the request will run, before its grammar is prepared and it is submitted
        (`hint`: the client's prompt_cache_key). One engine has one place: nothing to choose."""

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None, prefix: tuple[str, list[int]] | None = None,
                 on_text: Callable[[str], None] | None = None) -> list[int]:
        """Render messages (and tools, for templates that take them) with the model's own chat
        template, ready for generation. `template_kwargs` are more variables for the template
        (e.g. enable_thinking); the caller keeps them off apply_chat_template's own arguments.
        `prefix`: an earlier turn's (text, token ids), as the engine ran it: where the text starts
        with it, its ids are the first ids and only the rest is tokenized, so the prefix cache
        holds the earlier turn. `on_text` is handed the rendered text (what a turn stores)."""
        text = self._render(messages, tools, template_kwargs, True)
        if on_text is not None:
            on_text(text)
        head: list[int] = []
        if prefix is not None and text.startswith(prefix[0]):
            head, text = prefix[1], text[len(prefix[0]):]
        return [*head, *self.tokenizer.encode(text, add_special_tokens=False)]

    def turn_prefix_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template_kwargs: dict[str, Any] | None, sentinel: str) -> list[int] | None:
        """The token ids of the rendered messages up to where the last message's text (`sentinel`)
        starts: the prefix every next turn's prompt shares, whatever its text (None: the
        template does not render that text as given)."""
        text = self._render(messages, tools, template_kwargs, False)
        cut = text.find(sentinel)
        return None if cut < 0 else self.tokenizer.encode(text[:cut], add_special_tokens=False)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                template_kwargs: dict[str, Any] | None, generation_prompt: bool) -> str:
        self._check_text_fits(sum(len(str(m.get("content") or "")) for m in messages) + len(str(tools or ""))
                              + len(str(template_kwargs or "")))
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **extra))

    def _check_text_fits(self, chars: int) -> None:
        """A text longer than the context window could hold even at the longest token is refused
        before it is tokenized (tokenizing megabytes only to refuse them would tie up a thread)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        if chars > self.context_len * self._max_token_chars:
            raise InvalidParam("prompt", f"{chars} characters cannot fit the context window of {self.context_len} tokens "
                                         f"(a token is at most {self._max_token_chars} characters)")


def _check_namespace(tenant: str | None, cache_salt: str | None, public_prefix_len: int | None, prompt_len: int) -> None:
    for name, v in (("tenant", tenant), ("cache_salt", cache_salt)):
        if v is not None and (not isinstance(v, str) or not v):
            raise InvalidParam(name, f"expected a non-empty string or None, got {v!r}")
    if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidParam("cache_salt", f"{len(cache_salt)} characters, more than the limit of {MAX_CACHE_SALT_CHARS}")
    k = public_prefix_len
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= prompt_len):
        raise InvalidParam("public_prefix_len", f"{k!r} is not an integer in [0, {prompt_len}] (the prompt length)")
