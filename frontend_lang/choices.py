"""How `select` picks among its choices from their logprobs: SGLang's three methods, with
SGLang's names and call signature (a program may pass its own ChoicesSamplingMethod).

Each gets, per choice, `input_token_logprobs`: the [logprob, token_id, text] of the choice's
tokens in context, from two tokens before it (as SGLang's client scores them), and
`normalized_prompt_logprobs`: their mean."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[Any]], output_token_logprobs: list[list[Any]],
                 unconditional_token_logprobs: list[list[Any]] | None = None) -> ChoicesDecision: ...


def _meta(normalized: list[float], inputs: list[list[Any]], outputs: list[list[Any]], **extra: Any) -> dict[str, Any]:
    return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs, "output_token_logprobs": outputs,
            **extra}


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The highest mean logprob per token."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        return ChoicesDecision(choices[_argmax(normalized_prompt_logprobs)],
                               _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices with the best logprob at each position, until one is
    left. A shorter choice is padded with its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(row) for row in input_token_logprobs)
        matrix = []
        for row in input_token_logprobs:
            lps = [t[0] or 0.0 for t in row]  # a prompt's first token has no logprob
            mean = sum(lps) / len(lps) if lps else 0.0
            matrix.append(lps + [mean] * (width - len(lps)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], _meta(normalized_prompt_logprobs, input_token_logprobs,
                                                            output_token_logprobs, greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest mean of (logprob in context - logprob of the same tokens without it)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for row, alone in zip(input_token_logprobs, unconditional_token_logprobs):
            base = [t[0] or 0.0 for t in alone]  # the first token has no logprob on its own
            diffs = [t[0] - b for t, b in zip(row, base)]
            scores.append(sum(diffs) / len(diffs) if diffs else float("-inf"))
        return ChoicesDecision(choices[_argmax(scores)], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs, normalized_unconditional_prompt_logprobs=scores))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
METHODS = {"token_length_normalized": token_length_normalized, "greedy_token_selection": greedy_token_selection,
           "unconditional_likelihood_normalized": unconditional_likelihood_normalized}


def method(m: Any) -> ChoicesSamplingMethod:
    """A method object from an object or one of the three names."""
    if isinstance(m, ChoicesSamplingMethod):
        return m
    if isinstance(m, str) and m in METHODS:
        return METHODS[m]
    raise ValueError(f"choices_method must be a ChoicesSamplingMethod or one of {', '.join(METHODS)}, got {m!r}")
