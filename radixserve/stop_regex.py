"""stop_regex (SGLang's name): a request stops once its output matches one of these patterns.

The output then ends with the match (SGLang keeps it too; a stop *string* is cut off). Each
pattern is searched over the output's tail at every token, on the engine thread, so what a
pattern may cost is bounded here, when the request is validated:

- at most MAX_STOP_REGEXES patterns of MAX_STOP_REGEX_CHARS characters each (SGLang's caps);
- no unbounded repeat inside another one (`(a+)+`, `(\\w*)*`): Python's backtracking `re`
  can take exponential time on those;
- a match is looked for among the last `window` characters: the pattern's longest possible
  match, or MAX_UNBOUNDED_WINDOW characters for a pattern with an unbounded repeat;
- a request's searches at one token, all its patterns together, share a budget of
  SEARCH_BUDGET_S (the `regex` module's timeout), and after MEAN_AFTER_TOKENS tokens they may
  average at most MEAN_BUDGET_S per token: patterns that backtrack (`(a|aa)+b` on a run of
  a's) end their own request with an error naming the pattern (StopRegexTimeout) instead of
  slowing every request of the batch. 32 plain patterns search a 1,024-character tail in
  ~0.1 ms.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import regex

try:  # the parser behind `re` (sre_parse before Python 3.11)
    import re._parser as _parser  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _parser  # type: ignore[no-redef]

MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_CHARS = 256
MAX_UNBOUNDED_WINDOW = 1024
SEARCH_BUDGET_S = 0.002
MEAN_BUDGET_S = 0.0005
MEAN_AFTER_TOKENS = 16
_REPEATS = {_parser.MAX_REPEAT, _parser.MIN_REPEAT, getattr(_parser, "POSSESSIVE_REPEAT", None)} - {None}


class StopRegexError(ValueError):
    """Why a pattern is refused (the caller names the field)."""


class StopRegexTimeout(RuntimeError):
    """The searches took longer than their budget: the request ends with this as its error."""


@dataclass(frozen=True)
class StopRegex:
    pattern: str
    compiled: Any  # a `regex` pattern (re's syntax, searched with a timeout)
    window: int  # characters of the output's tail a match can span


def as_list(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


@lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    if not isinstance(pattern, str) or not pattern:
        raise StopRegexError("every pattern must be a non-empty string")
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise StopRegexError(f"a pattern of {len(pattern)} characters is longer than the limit of {MAX_STOP_REGEX_CHARS}")
    try:
        re.compile(pattern)  # Python's syntax, as SGLang takes it
        tree = _parser.parse(pattern)
        compiled = regex.compile(pattern, regex.VERSION0)
    except (re.error, regex.error, RecursionError, OverflowError) as e:
        raise StopRegexError(f"{pattern!r} is not a valid regular expression: {e}") from None
    if _nested_unbounded(tree, inside=False):
        raise StopRegexError(f"{pattern!r} repeats an unbounded repeat (like (a+)+), which can take exponential time")
    lo, hi = tree.getwidth()
    if lo == 0:
        raise StopRegexError(f"{pattern!r} matches the empty string: it would stop every request at once")
    window = MAX_UNBOUNDED_WINDOW if hi >= _parser.MAXREPEAT else max(hi, 1)
    return StopRegex(pattern, compiled, min(window, MAX_UNBOUNDED_WINDOW))


def validate(value: object) -> list[StopRegex]:
    """The compiled patterns, or StopRegexError saying what is wrong."""
    if value is None:
        return []
    if not isinstance(value, str | list | tuple):
        raise StopRegexError("expected a string or a list of strings")
    patterns = as_list(value)  # type: ignore[arg-type]
    if len(patterns) > MAX_STOP_REGEXES:
        raise StopRegexError(f"{len(patterns)} patterns, more than the limit of {MAX_STOP_REGEXES}")
    return [compile_stop_regex(p) for p in patterns]


def _nested_unbounded(items: object, inside: bool) -> bool:
    """Whether an unbounded repeat sits (at any depth) inside another unbounded repeat."""
    for op, arg in items:  # type: ignore[attr-defined]
        if op in _REPEATS:
            lo, hi, sub = arg
            unbounded = hi >= _parser.MAXREPEAT
            if unbounded and inside:
                return True
            if _nested_unbounded(sub, inside or unbounded):
                return True
        elif op is _parser.SUBPATTERN:
            if _nested_unbounded(arg[-1], inside):
                return True
        elif op is _parser.BRANCH:
            if any(_nested_unbounded(b, inside) for b in arg[1]):
                return True
        elif op in (_parser.ASSERT, _parser.ASSERT_NOT):
            if _nested_unbounded(arg[1], inside):
                return True
        elif op is getattr(_parser, "ATOMIC_GROUP", None):
            if _nested_unbounded(arg, inside):
                return True
    return False


def find(regexes: list[StopRegex], text: str, old_len: int) -> tuple[int, str] | None:
    """The earliest end of a match that takes in text past `old_len` (what the last token added),
    and its pattern; None if no pattern matches."""
    best: tuple[int, str] | None = None
    deadline = time.perf_counter() + SEARCH_BUDGET_S
    for r in regexes:
        start = max(0, old_len - r.window + 1)
        try:
            for m in r.compiled.finditer(text, start, timeout=max(deadline - time.perf_counter(), 1e-6)):
                if m.end() > old_len:
                    if best is None or m.end() < best[0]:
                        best = (m.end(), r.pattern)
                    break
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {r.pattern!r}: the request's patterns took over {SEARCH_BUDGET_S * 1000:g} ms "
                                   "to search the output at one token (they backtrack): simplify them") from None
    return best


class Searcher:
    """One request's patterns, with the time its searches took (see the module's budgets)."""

    def __init__(self, regexes: list[StopRegex]) -> None:
        self.regexes = regexes
        self.spent = 0.0
        self.searches = 0

    def find(self, text: str, old_len: int) -> tuple[int, str] | None:
        t0 = time.perf_counter()
        hit = find(self.regexes, text, old_len)
        self.spent += time.perf_counter() - t0
        self.searches += 1
        if self.searches >= MEAN_AFTER_TOKENS and self.spent > self.searches * MEAN_BUDGET_S:
            raise StopRegexTimeout(f"stop_regex {self.regexes[0].pattern!r}: the request's patterns took "
                                   f"{self.spent / self.searches * 1000:.2f} ms a token to search the output, more than "
                                   f"{MEAN_BUDGET_S * 1000:g} ms (they backtrack): simplify them")
        return hit
