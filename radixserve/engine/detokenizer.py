"""Incremental, UTF-8-safe detokenization with stop strings found across token boundaries.

Text is decoded over a sliding window that starts a few tokens back (so a word-initial
space survives), and a delta is released only when it does not end in a partial UTF-8
character. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import Any

from radixserve import stop_regex
from radixserve.stop_regex import StopRegex

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str], skip_special_tokens: bool = True,
                 regexes: list[StopRegex] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stops = stops
        self.regexes = stop_regex.Searcher(regexes) if regexes else None
        self.tokens: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # output text so far (cut at a stop string once one is found)
        self.emitted = 0  # chars of `text` already handed out
        self.stopped_on: str | None = None  # the stop string (cut off) or stop_regex pattern (kept) it stopped on

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        """Append one token; may set `stopped_on` (the text is then cut before the stop string)."""
        if self.stopped_on is not None:
            return
        self.tokens.append(token_id)
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return
        old = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._find_stop(old)

    def _find_stop(self, old_len: int) -> None:
        """The earliest stop in the new text: a stop string is cut off, a stop_regex match kept."""
        cuts = []
        if self.stops:
            start = max(0, old_len - max(len(s) for s in self.stops) + 1)
            cuts = [(pos, s) for s in self.stops if (pos := self.text.find(s, start)) >= 0]
        if self.regexes is not None and (hit := self.regexes.find(self.text, old_len)) is not None:
            cuts.append(hit)  # (end of the match, pattern)
        if cuts:
            pos, s = min(cuts)
            self.text = self.text[:pos]
            self.stopped_on = s

    def flush(self) -> None:
        """At finish: release a trailing partial character rather than lose it."""
        if self.stopped_on is None and self.read_offset < len(self.tokens):
            self._advance(final=True)

    def take_delta(self, finished: bool) -> str:
        """New text that is safe to show; everything once finished."""
        end = len(self.text)
        if not finished and self.stops:
            end -= _held_back(self.text, self.stops)
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
