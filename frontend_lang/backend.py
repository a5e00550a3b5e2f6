"""RuntimeEndpoint: a radixserve (or SGLang) server's native /generate, over one pooled
aiohttp session. Roles render with the served model's own chat template (from /server_info)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from frontend_lang.ir import Gen, Select

Chunk = tuple[str, dict[str, Any]]  # (new text, meta so far)
_MARK = "\x00radixserve-role\x00"
_OPEN: set[RuntimeEndpoint] = set()  # endpoints with a live session, closed at exit


class FrontendError(RuntimeError):
    """A call failed: the message names the call, the variable and what the server said."""


class RuntimeEndpoint:
    """A radixserve server's native API. `cache_salt` keeps this endpoint's prefixes apart from
    other callers of the same tenant; a program's `public_prefix_end()` mark is sent as
    `public_prefix_len` (the tenant must be allowed the public prefix)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0,
                 cache_salt: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.cache_salt = cache_salt
        self._template: str | None = None
        self._roles: dict[str, tuple[str, str]] = {}
        self._token_counts: dict[str, int] = {}
        self._session: Any = None

    # -- HTTP --------------------------------------------------------------------------------
    def _client(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            _OPEN.add(self)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        return self._session

    @asynccontextmanager
    async def _open(self, method: str, path: str, what: str, body: Any = None) -> AsyncIterator[Any]:
        """The response once its status is good; every failure (also while the body is read)
        becomes a FrontendError naming the call."""
        import aiohttp

        url = self.base_url + path
        try:
            async with self._client().request(method, url, json=body) as r:
                if r.status >= 400:
                    data = await r.json(content_type=None)
                    msg = data.get("error", {}).get("message", data) if isinstance(data, dict) else data
                    raise FrontendError(f"{what}: the server answered {r.status}: {msg}")
                yield r
        except aiohttp.ClientConnectionError as e:
            raise FrontendError(f"{what}: cannot reach {url}: {e}") from None
        except aiohttp.ContentTypeError as e:
            raise FrontendError(f"{what}: {url} did not answer JSON: {e}") from None
        except TimeoutError:
            raise FrontendError(f"{what}: no answer from {url} within {self.timeout:g} s") from None

    async def request(self, method: str, path: str, what: str, body: Any = None) -> Any:
        async with self._open(method, path, what, body) as r:
            return await r.json(content_type=None)

    async def events(self, path: str, what: str, body: Any) -> AsyncIterator[Any]:
        """POST a streaming request; yield each server-sent `data:` object until [DONE]."""
        async with self._open("POST", path, what, body) as r:
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
        raise FrontendError(f"{what}: the stream from {self.base_url + path} ended before [DONE] (cut off)")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def server_info(self) -> dict[str, Any]:
        return await self.request("GET", "/server_info", "get_server_info")

    # -- roles -------------------------------------------------------------------------------
    async def role(self, role: str) -> tuple[str, str]:
        """The text that opens and closes a message of `role`, rendered by the model's template."""
        if role not in self._roles:
            if self._template is None:
                self._template = (await self.server_info()).get("chat_template") or ""
            self._roles[role] = _role_text(self._template, role)
        return self._roles[role]

    # -- calls -------------------------------------------------------------------------------
    async def _options(self, prompt: str, public_chars: int, what: str) -> dict[str, Any]:
        """cache_salt, and the public prefix in tokens: that of its text alone, less one token in
        case the last one merges with what follows."""
        opts: dict[str, Any] = {"cache_salt": self.cache_salt} if self.cache_salt else {}
        if public_chars:
            head = prompt[:public_chars]
            if head not in self._token_counts:
                self._token_counts[head] = (await self._measure(head, what, opts))["prompt_tokens"]
            opts["public_prefix_len"] = max(self._token_counts[head] - 1, 0)
        return opts

    async def _measure(self, text: str, what: str, opts: dict[str, Any]) -> dict[str, Any]:
        """The server's meta_info for `text` with nothing generated: its length in tokens."""
        r = await self.request("POST", "/generate", what, {"text": text, "sampling_params": {"max_new_tokens": 0}, **opts})
        return r["meta_info"]

    async def _gen_body(self, prompt: str, g: Gen, what: str, public_chars: int) -> dict[str, Any]:
        body: dict[str, Any] = {"text": prompt, "sampling_params": g.params, **await self._options(prompt, public_chars, what)}
        if g.return_logprob:
            body.update(return_logprob=True, top_logprobs_num=g.top_logprobs_num or 0)
            if g.logprob_start_len is not None:
                body["logprob_start_len"] = g.logprob_start_len
        return body

    async def generate(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        r = await self.request("POST", "/generate", what, await self._gen_body(prompt, g, what, public_chars))
        return r["text"], _checked(r["meta_info"], what)

    async def generate_stream(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> AsyncIterator[Chunk]:
        """(new text, meta so far) as the server streams it."""
        body = {**await self._gen_body(prompt, g, what, public_chars), "stream": True}
        text = ""
        async for chunk in self.events("/generate", what, body):
            delta, text = chunk["text"][len(text):], chunk["text"]  # the native stream's text is cumulative
            yield delta, _checked(chunk["meta_info"], what)

    async def select(self, prompt: str, s: Select, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        """Score every choice from prompt logprobs in one batched request (plus one to measure the prefix)."""
        opts = await self._options(prompt, public_chars, what)
        zero = {"max_new_tokens": 0}
        prefix = await self._measure(prompt, what, opts)
        # A few tokens before the prefix's end: the last prefix token may merge with a choice
        # ("is " + "Paris" -> "is", " Paris"); the choices' tokens start where they first differ.
        start = max(prefix["prompt_tokens"] - 8, 0)
        scored = await self.request("POST", "/generate", what, {
            "text": [prompt + c for c in s.choices], "sampling_params": zero, "return_logprob": True, "logprob_start_len": start,
            **opts})
        rows = [[(t[0], t[1]) for t in r["meta_info"]["input_token_logprobs"] if t[0] is not None] for r in scored]
        lps = [[lp for lp, _ in row[_shared_len(rows):]] or [row[-1][0] if row else 0.0] for row in rows]
        if s.choices_method == "greedy_token_selection":
            scores = [lp[0] for lp in lps]
        else:
            scores = [sum(lp) / len(lp) for lp in lps]
        if s.choices_method == "unconditional_likelihood_normalized":
            alone = await self.request("POST", "/generate", what, {
                "text": s.choices, "sampling_params": zero, "return_logprob": True, "logprob_start_len": 0,
                **({"cache_salt": self.cache_salt} if self.cache_salt else {})})
            base = [[t[0] for t in r["meta_info"]["input_token_logprobs"] if t[0] is not None] or [0.0] for r in alone]
            scores = [sc - sum(b) / len(b) for sc, b in zip(scores, base)]
        best = max(range(len(scores)), key=scores.__getitem__)
        cached = prefix.get("cached_tokens", 0) + sum(r["meta_info"].get("cached_tokens", 0) for r in scored)
        return s.choices[best], {"normalized_prompt_logprobs": scores, "input_token_logprobs": lps, "cached_tokens": cached}


def _checked(meta: dict[str, Any], what: str) -> dict[str, Any]:
    """A request the server ended with an error (e.g. a failed grammar) raises, naming the call."""
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "error":
        raise FrontendError(f"{what}: the server failed the request: {finish.get('message')}")
    return meta


def _shared_len(rows: list[list[tuple[float, int]]]) -> int:
    """Leading positions where every choice has the same token (the prefix)."""
    if len(rows) < 2:
        return 0
    n = min(len(r) for r in rows)
    return next((i for i in range(n) if len({r[i][1] for r in rows}) > 1), n)


def _role_text(template: str | None, role: str) -> tuple[str, str]:
    if not template:
        return "", "\n"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    t = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)

    def render(messages: list[dict[str, str]], gen: bool = False) -> str:
        return t.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="")

    sys = [{"role": "system", "content": "S"}]
    base = render(sys) if role != "system" else ""
    full = render([*sys, {"role": role, "content": _MARK}] if role != "system" else [{"role": "system", "content": _MARK}])
    begin, _, end = full[len(base):].partition(_MARK)
    if role == "assistant":
        begin = render(sys, gen=True)[len(base):] or begin
    return begin, end
