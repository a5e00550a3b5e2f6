"""OpenAI: any OpenAI-compatible server (radixserve's included) for programs that only need
`gen`. The program's text goes to /v1/completions; features that need the native API
(`select`, `json_schema`, the public prefix) are clear errors, not silent approximations."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from frontend_lang.backend import Chunk, FrontendError, RuntimeEndpoint
from frontend_lang.ir import SAMPLING_DEFAULTS, Gen, Select

# gen parameter -> the completions field (radixserve's extras included: top_k, min_p, regex, ...)
_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "n": "n", "stop": "stop",
           "stop_token_ids": "stop_token_ids", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
           "ignore_eos": "ignore_eos", "regex": "regex"}


class OpenAI(RuntimeEndpoint):
    def __init__(self, model: str, base_url: str = "https://api.openai.com/v1", api_key: str | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(base_url, api_key, timeout=timeout)
        self.model = model

    def cache_prefix(self, prefix: str) -> None:
        """Nothing to precompute: an OpenAI server has no prompt-only request (run_batch calls this)."""

    async def default_system(self) -> tuple[str, str]:
        return "", ""

    async def role(self, role: str) -> tuple[str, str]:
        """Plain-text roles: an OpenAI server does not publish its chat template."""
        return f"{role.capitalize()}: ", "\n"

    def _body(self, prompt: str, g: Gen, what: str, public_chars: int) -> dict[str, Any]:
        for native in ("json_schema", "stop_regex"):
            if g.params.get(native):
                raise FrontendError(f"{what}: {native} needs the native API (RuntimeEndpoint); the OpenAI backend sends "
                                    "plain completions")
        if public_chars:
            raise FrontendError(f"{what}: public_prefix_end needs the native API (RuntimeEndpoint)")
        body: dict[str, Any] = {"model": self.model, "prompt": prompt}
        for k, field in _FIELDS.items():
            v = g.params.get(k)
            if v is not None and v != [] and (k == "max_new_tokens" or v != SAMPLING_DEFAULTS.get(k)):
                body[field] = v  # what the program set: a strict OpenAI server refuses the extras it does not know
        if g.params.get("return_logprob"):
            body["logprobs"] = g.params.get("top_logprobs_num") or 0
        return body

    async def generate(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> tuple[Any, Any]:
        r = await self.request("POST", "/completions", what, self._body(prompt, g, what, public_chars))
        metas = [{"finish_reason": c.get("finish_reason"), "usage": r.get("usage")} for c in r["choices"]]
        if len(r["choices"]) > 1:
            return [c["text"] for c in r["choices"]], metas
        return r["choices"][0]["text"], metas[0]

    async def generate_stream(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> AsyncIterator[Chunk]:
        body = {**self._body(prompt, g, what, public_chars), "stream": True}
        async for chunk in self.events("/completions", what, body):
            for choice in chunk.get("choices") or []:  # a usage-only chunk has none
                yield choice.get("text") or "", {"finish_reason": choice.get("finish_reason")}

    async def select(self, prompt: str, s: Select, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        raise FrontendError(f"{what}: select needs prompt logprobs from the native API; use RuntimeEndpoint, or gen with "
                            "a regex alternation of the choices")
