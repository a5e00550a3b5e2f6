"""Reasoning models: split `<think>...</think>` reasoning from the answer (`--reasoning-parser`).

    qwen3        output:  [ws] <think> reasoning </think> [ws] content   (or only content)
    deepseek_r1  prompt:  ... <think>            (the chat template opens the reasoning)
                 output:  [<think>] reasoning </think> [ws] content

The streaming splitter hands each text delta back as (reasoning, content). A tag split across
deltas is held back until it is whole (or the output ends), so no tag text leaks either way.
`split` runs the same splitter over a whole text: a stream and its whole answer always agree.
Whitespace right after a tag is dropped; output without tags (qwen3) is content, unchanged.
"""

from __future__ import annotations

from typing import Any

OPEN, CLOSE = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek_r1": True}  # parser -> the output starts inside the reasoning
MARKER = CLOSE  # a constraint (JSON, a tool call) applies from here on: SamplingParams.grammar_after


class ThinkSplitter:
    """States: start | open? -> think_ws -> think -> content_ws -> content (start may go straight
    to content). NOTE: `_held` is text not handed out yet: it may be (the start of) a tag, or
    whitespace after one."""

    def __init__(self, starts_inside: bool) -> None:
        self.state = "open?" if starts_inside else "start"
        self._held = ""
        self.saw_reasoning = starts_inside

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one more text delta."""
        out: dict[str, list[str]] = {"r": [], "c": []}
        self._held += text
        while self._held and self._step(out):
            pass
        return "".join(out["r"]), "".join(out["c"])

    def flush(self) -> tuple[str, str]:
        """What was held back, once the output has ended (an unfinished tag is plain text)."""
        held, self._held = self._held, ""
        return ("", held) if self.state in ("start", "content") else (held, "")

    def _step(self, out: dict[str, list[str]]) -> bool:
        """Hand out what can be decided of `_held`; False when the rest must wait for more text."""
        h, state = self._held, self.state
        if state in ("start", "open?"):  # an optional <think> first, maybe after whitespace
            lead = h.lstrip()
            if lead.startswith(OPEN):
                self._held, self.state, self.saw_reasoning = lead[len(OPEN):], "think_ws", True
                return True
            if OPEN.startswith(lead):
                return False
            self.state = "think_ws" if state == "open?" else "content"
            return True
        if state in ("think_ws", "content_ws"):
            self._held = h.lstrip()
            if self._held:
                self.state = "think" if state == "think_ws" else "content"
            return bool(self._held)
        if state == "content":
            out["c"].append(h)
            self._held = ""
            return False
        end = h.find(CLOSE)
        if end >= 0:
            out["r"].append(h[:end])
            self._held, self.state = h[end + len(CLOSE):], "content_ws"
            return True
        keep = _partial_tail(h, CLOSE)
        out["r"].append(h[:len(h) - keep])
        self._held = h[len(h) - keep:]
        return False


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def thinking_on(template_kwargs: dict[str, Any] | None) -> bool:
    """False when the client turned thinking off in the chat template (Qwen3's enable_thinking,
    DeepSeek V3.1's thinking): the template then closes the reasoning in the prompt itself."""
    kw = template_kwargs or {}
    return kw.get("enable_thinking") is not False and kw.get("thinking") is not False


def splitter(parser: str | None) -> ThinkSplitter | None:
    """A fresh splitter for one choice, or None when there is nothing to split."""
    return None if parser is None else ThinkSplitter(PARSERS[parser])


def feed(s: ThinkSplitter | None, text: str, final: bool = False) -> tuple[str, str]:
    """(reasoning, content) of one delta; `final`: the output ends with it."""
    if s is None:
        return "", text
    r, c = s.feed(text)
    if final:
        r2, c2 = s.flush()
        r, c = r + r2, c + c2
    return r, c


def split(text: str, parser: str | None) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content): (None, text) when there is no reasoning;
    content None when the output was all reasoning (e.g. cut off by max_tokens)."""
    s = splitter(parser)
    r, c = feed(s, text, final=True)
    if s is None or not s.saw_reasoning:
        return None, text
    return r, c or None
