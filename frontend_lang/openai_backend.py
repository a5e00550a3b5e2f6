"""OpenAI: any OpenAI-compatible server (radixserve's included) for programs that only need
`gen`. The program's text goes to /v1/completions; features that need the native API
(`select`, `json_schema`, the public prefix) are clear errors, not silent approximations."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from frontend_lang.backend import Chunk, FrontendError, RuntimeEndpoint
from frontend_lang.ir import Gen, Select

_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class OpenAI(RuntimeEndpoint):
    def __init__(self, model: str, base_url: str = "https://api.openai.com/v1", api_key: str | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(base_url, api_key, timeout)
        self.model = model

    async def role(self, role: str) -> tuple[str, str]:
        """Plain-text roles: an OpenAI server does not publish its chat template."""
        return f"{role.capitalize()}: ", "\n"

    def _body(self, prompt: str, g: Gen, what: str, public_chars: int) -> dict[str, Any]:
        if "json_schema" in g.params:
            raise FrontendError(f"{what}: json_schema needs the native API (RuntimeEndpoint); the OpenAI backend sends "
                                "plain completions")
        if public_chars:
            raise FrontendError(f"{what}: public_prefix_end needs the native API (RuntimeEndpoint)")
        body: dict[str, Any] = {"model": self.model, "prompt": prompt}
        for k, v in g.params.items():
            body[_OPENAI_NAMES.get(k, k)] = v
        if g.return_logprob:
            body["logprobs"] = g.top_logprobs_num or 0
        return body

    async def generate(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        r = await self.request("POST", "/completions", what, self._body(prompt, g, what, public_chars))
        choice = r["choices"][0]
        return choice["text"], {"finish_reason": choice.get("finish_reason"), "usage": r.get("usage")}

    async def generate_stream(self, prompt: str, g: Gen, what: str, public_chars: int = 0) -> AsyncIterator[Chunk]:
        body = {**self._body(prompt, g, what, public_chars), "stream": True}
        async for chunk in self.events("/completions", what, body):
            for choice in chunk.get("choices") or []:  # a usage-only chunk has none
                yield choice.get("text") or "", {"finish_reason": choice.get("finish_reason")}

    async def select(self, prompt: str, s: Select, what: str, public_chars: int = 0) -> tuple[str, dict[str, Any]]:
        raise FrontendError(f"{what}: select needs prompt logprobs from the native API; use RuntimeEndpoint, or gen with "
                            "a regex alternation of the choices")
