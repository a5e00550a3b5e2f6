"""separate_reasoning's parsers: the thinking markers of SGLang's `<think>`-style model types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool  # the model starts thinking without writing `start` (its template already did)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer)."""
        if self.start in text:
            before, _, rest = text.partition(self.start)
        elif self.forced:
            before, rest = "", text
        else:
            return "", text.strip()
        reasoning, found, after = rest.partition(self.end)
        return reasoning.strip(), (before + after).strip() if found else before.strip()


_THINK = ReasoningFormat("<think>", "</think>", False)
_FORCED = ReasoningFormat("<think>", "</think>", True)
FORMATS = {"deepseek-r1": _FORCED, "step3": _FORCED, "qwen3": _THINK, "qwen3-thinking": _FORCED, "glm45": _THINK,
           "minimax": _THINK, "nanbeige": _THINK, "interns1": _THINK, "dots": _THINK, "mimo": _THINK,
           "kimi": ReasoningFormat("\u25c1think\u25b7", "\u25c1/think\u25b7", False)}


def parser(model_type: str | None) -> ReasoningFormat:
    if not model_type:
        raise ValueError("separate_reasoning: model_type must be given (e.g. 'deepseek-r1', 'qwen3')")
    fmt = FORMATS.get(model_type.lower())
    if fmt is None:
        raise ValueError(f"separate_reasoning: model_type {model_type!r} is not supported here; known: "
                         f"{', '.join(sorted(FORMATS))}")
    return fmt
