"""RuntimeEndpoint: a radixserve server's native /generate (SGLang's shape), over one pooled
aiohttp session. Roles render with the served model's own chat template (from /server_info)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from frontend_lang import choices
from frontend_lang.global_config import global_config
from frontend_lang.ir import Gen, Select
from frontend_lang.loop import OPEN, submit

Chunk = tuple[str, dict[str, Any]]  # (new text, meta so far)
SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                 "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex", "json_schema")
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_MARK = "\x00radixserve-role\x00"


class FrontendError(RuntimeError):
    """A call failed: the message names the call, the variable and what the server said."""


class RuntimeEndpoint:
    """A radixserve server's native API, with SGLang's arguments: `verify` (a CA bundle's path,
    or False) checks an https server; `chat_template_name` picks one of SGLang's named templates
    (chatml, llama-3-instruct, ...) instead of the served model's own, which is the default.

    radixserve's extras: `cache_salt` keeps this endpoint's prefixes apart from other callers of
    the same tenant; a program's `public_prefix_end()` mark is sent as `public_prefix_len` (the
    tenant must be allowed the public prefix)."""

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | bool | None = None,
                 chat_template_name: str | None = None, *, timeout: float = 300.0, cache_salt: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self.cache_salt = cache_salt
        self.chat_template_name = chat_template_name
        self._named = named_template(chat_template_name) if chat_template_name else None
        self._template: str | None = None
        self._roles: dict[str, tuple[str, str]] = {}
        self._token_counts: dict[str, int] = {}
        self._session: Any = None
        self._model_info: dict[str, Any] | None = None
        self._default_system: tuple[str, str] | None = None

    # -- SGLang's synchronous calls ----------------------------------------------------------
    def _sync(self, coro: Any) -> Any:
        return submit(coro).result()

    def get_model_info(self) -> dict[str, Any]:
        if self._model_info is None:
            self._model_info = self._sync(self.request("GET", "/model_info", "get_model_info"))
        return self._model_info

    def get_model_name(self) -> str:
        return self.get_model_info()["model_path"]

    def get_server_info(self) -> dict[str, Any]:
        return self._sync(self.server_info())

    def flush_cache(self) -> Any:
        return self._sync(self.request("POST", "/flush_cache", "flush_cache", {}))

    def cache_prefix(self, prefix: str) -> None:
        """Compute (and cache) the KV of `prefix` now (run_batch does this for its programs'
        shared prefix)."""
        self._sync(self._measure(prefix, "cache_prefix", self._salt()))

    # -- HTTP --------------------------------------------------------------------------------
    def _client(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            OPEN.add(self)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
                                                  connector=aiohttp.TCPConnector(ssl=_ssl(self.verify)))
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
            async for obj in sse_objects(r.content, f"{what}: the stream from {self.base_url + path}"):
                yield obj

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def server_info(self) -> dict[str, Any]:
        return await self.request("GET", "/server_info", "get_server_info")

    # -- roles -------------------------------------------------------------------------------
    async def role(self, role: str) -> tuple[str, str]:
        """The text that opens and closes a message of `role`: the named template's, or as the
        served model's own chat template renders it."""
        if self._named is not None:
            return self._named.get(role, ("", ""))
        if role not in self._roles:
            if self._template is None:
                self._template = (await self.server_info()).get("chat_template") or ""
            self._roles[role] = _role_text(self._template, role)
        return self._roles[role]

    async def default_system(self) -> tuple[str, str]:
        """(text, its content): the system message the model's template adds before a
        conversation that opens with another role ("" for SGLang's named templates, which have
        none). SGLang's interpreter inserts its template's default system prompt the same way."""
        if self._named is not None:
            return "", ""
        if self._default_system is None:
            begin, end = await self.role("system")
            text = _default_system(self._template, (await self.role("user"))[0])
            content = text[len(begin):-len(end) or None] if begin and text.startswith(begin) and text.endswith(end) else ""
            self._default_system = (text, content)
        return self._default_system

    # -- calls -------------------------------------------------------------------------------
    def _salt(self) -> dict[str, Any]:
        return {"cache_salt": self.cache_salt} if self.cache_salt else {}

    async def _options(self, prompt: str, public_chars: int, what: str) -> dict[str, Any]:
        """cache_salt, and the public prefix in tokens: that of its text alone, less one token in
        case the last one merges with what follows."""
        opts = self._salt()
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
        """SGLang's /generate body for a gen whose parameters are resolved (run() defaults filled in)."""
        p = g.params
        sampling = {"skip_special_tokens": global_config.skip_special_tokens_in_output,
                    "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                    **{k: p[k] for k in SAMPLING_KEYS if p.get(k) is not None}}
        body: dict[str, Any] = {"text": prompt, "sampling_params": sampling,
                                **{k: p[k] for k in LOGPROB_KEYS if p.get(k) is not None},
                                **await self._options(prompt, public_chars, what)}
        return body

    async def generate(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> tuple[Any, Any]:
        """(text, meta_info); with n > 1 samples, a list of each."""
        r = await self.request("POST", "/generate", what, await self._gen_body(prompt, g, what, public_chars))
        if isinstance(r, list):
            return [x["text"] for x in r], [_checked(x["meta_info"], what) for x in r]
        return r["text"], _checked(r["meta_info"], what)

    async def generate_stream(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> AsyncIterator[Chunk]:
        """(new text, meta so far) as the server streams it."""
        body = {**await self._gen_body(prompt, g, what, public_chars), "stream": True}
        text = ""
        async for chunk in self.events("/generate", what, body):
            delta, text = chunk["text"][len(text):], chunk["text"]  # the native stream's text is cumulative
            yield delta, _checked(chunk["meta_info"], what)

    async def select(self, prompt: str, s: Select, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        """Score every choice from prompt logprobs, as SGLang's client does (so the same program
        picks the same choice): one request computes the prompt (the choices then share it
        through the cache), one batched request scores prompt + choice from two tokens before
        the choice (a last prompt token that merges with the choice is scored with it), and the
        method picks from those logprobs."""
        opts = await self._options(prompt, public_chars, what)
        prefix = await self._measure(prompt, what, opts)
        scored = await self.request("POST", "/generate", what, {
            "text": [prompt + c for c in s.choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": max(prefix["prompt_tokens"] - 2, 0), **opts})
        inputs = [r["meta_info"]["input_token_logprobs"] for r in scored]
        outputs = [r["meta_info"]["output_token_logprobs"] or [] for r in scored]
        normalized = [_mean_logprob(row) for row in inputs]
        for i, row in enumerate(inputs):  # SGLang's token healing: the first token is the prompt's own
            if len(row) > 1 and row[0][2] is not None and prompt.endswith(row[0][2]):
                normalized[i] = (normalized[i] * len(row) - (row[0][0] or 0.0)) / (len(row) - 1)
                inputs[i] = row[1:]
        method = choices.method(s.choices_method)
        unconditional = None
        if method.requires_unconditional_logprobs:  # the same tokens without the prompt, from the first
            alone = await self.request("POST", "/generate", what, {
                "input_ids": [[t[1] for t in row] for row in inputs], "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0, **self._salt()})
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in alone]
        decision = method(choices=s.choices, normalized_prompt_logprobs=normalized, input_token_logprobs=inputs,
                          output_token_logprobs=outputs, unconditional_token_logprobs=unconditional)
        cached = prefix.get("cached_tokens", 0) + sum(r["meta_info"].get("cached_tokens", 0) for r in scored)
        return decision.decision, {**(decision.meta_info or {}), "cached_tokens": cached}


def _mean_logprob(row: list[Any]) -> float:
    """SGLang's normalized prompt logprob: the mean of the logprobs there are (the first
    token of a prompt has none)."""
    values = [t[0] for t in row if t[0]]
    return sum(values) / len(values) if values else float("-inf")


async def sse_objects(content: Any, where: str) -> AsyncIterator[Any]:
    """Each server-sent `data:` object of a response body until [DONE]; a body that ends
    before it is a FrontendError (`where` says whose stream was cut off)."""
    async for line in content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)
    raise FrontendError(f"{where} ended before [DONE] (cut off)")


def _checked(meta: dict[str, Any], what: str) -> dict[str, Any]:
    """A request the server ended with an error (e.g. a failed grammar) raises, naming the call."""
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "error":
        raise FrontendError(f"{what}: the server failed the request: {finish.get('message')}")
    return meta


def _renderer(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    t = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)

    def render(messages: list[dict[str, str]], gen: bool = False) -> str:
        return t.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="")

    return render


def _default_system(template: str | None, user_begin: str) -> str:
    """What the template puts before a conversation that starts without a system message (its
    default system prompt: SmolLM2's, Qwen's, ...), or ""."""
    if not template:
        return ""
    try:
        head = _renderer(template)([{"role": "user", "content": _MARK}]).partition(_MARK)[0]
    except Exception:  # noqa: BLE001  a template that refuses a lone user message has no default to add
        return ""
    return head[: -len(user_begin)] if user_begin and head.endswith(user_begin) else ""


def _role_text(template: str | None, role: str) -> tuple[str, str]:
    if not template:
        return "", "\n"
    render = _renderer(template)
    sys = [{"role": "system", "content": "S"}]
    base = render(sys) if role != "system" else ""
    full = render([*sys, {"role": role, "content": _MARK}] if role != "system" else [{"role": "system", "content": _MARK}])
    begin, _, end = full[len(base):].partition(_MARK)
    if role == "assistant":
        begin = render(sys, gen=True)[len(base):] or begin
    return begin, end


def _ssl(verify: str | bool | None) -> Any:
    """aiohttp's ssl argument for SGLang's `verify`: a CA bundle's path, False (no checks), or None."""
    if verify is None or verify is True:
        return True
    if verify is False:
        return False
    import ssl

    return ssl.create_default_context(cafile=str(verify))


# SGLang's named chat templates (role -> (prefix, suffix)), for `chat_template_name=`.
NAMED_TEMPLATES: dict[str, dict[str, tuple[str, str]]] = {
    "default": {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
    "chatml": {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")},
    "llama-3-instruct": {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
                         for r in ("system", "user", "assistant")},
    "claude": {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")},
}


def named_template(name: str) -> dict[str, tuple[str, str]]:
    if name not in NAMED_TEMPLATES:
        raise ValueError(f"chat_template_name: {name!r} is not one of {', '.join(NAMED_TEMPLATES)} (leave it unset to use "
                         "the served model's own template)")
    return NAMED_TEMPLATES[name]
