"""What the engine hands back: a streamed Delta per step, a final Output per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.request import TokenLogprob


@dataclass
class Output:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_field: str | None = None  # an error that is the request's (a parameter refused late): the field it names


@dataclass
class Delta:
    rid: str
    text: str  # new text since the previous delta
    token_ids: list[int] = field(default_factory=list)  # new tokens
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    output: Output | None = None  # set on the last delta
    cached_tokens: int = 0  # prompt tokens the request found in the prefix cache (known once admitted)
