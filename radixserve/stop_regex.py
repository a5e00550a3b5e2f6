"""stop_regex (SGLang's name): a request stops once its output matches one of these patterns.

The output then ends with the match (SGLang keeps it too; a stop *string* is cut off). Each
pattern is searched over the output's tail at every token, on the engine thread, so what a
pattern may cost is bounded, first when the request is validated:

- at most MAX_STOP_REGEXES patterns of MAX_STOP_REGEX_CHARS characters each (SGLang's caps);
- no pattern that matches the empty string (it would stop every request at once);
- no unbounded repeat inside another one (`(a+)+`, `(\\w*)*`): a backtracking engine can take
  exponential time on those;
- no pattern whose counted repeats multiply past MAX_EXPANSION (`(?:a{1000}){1000}`: its
  compiled form alone takes hundreds of MB), nor one that can only match more than WINDOW
  characters (it could never be found in the tail that is searched);

then while it runs:

- a match is looked for among the last `window` characters: the pattern's longest possible
  match, or WINDOW characters for a pattern with an unbounded repeat;
- a request's searches may use SEARCH_BUDGET_S of CPU time in all over its first
  BUDGET_TOKENS tokens, and MEAN_BUDGET_S per token on average after that; one search that
  runs past HARD_TIMEOUT_S of wall time (the `regex` module's timeout: catastrophic
  backtracking, `(a|aa)+b` on a run of a's) is stopped. Past either, the request ends with an
  error naming the pattern (StopRegexTimeout), and the other requests of the batch go on. 32
  plain patterns search a 1,024-character tail in ~0.1 ms.
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
MAX_EXPANSION = 4096
WINDOW = 1024
MEAN_BUDGET_S = 0.0005
BUDGET_TOKENS = 16
SEARCH_BUDGET_S = MEAN_BUDGET_S * BUDGET_TOKENS  # 8 ms of CPU for the first tokens
HARD_TIMEOUT_S = 0.05
_REPEATS = {_parser.MAX_REPEAT, _parser.MIN_REPEAT, getattr(_parser, "POSSESSIVE_REPEAT", None)} - {None}
_ATOMIC = getattr(_parser, "ATOMIC_GROUP", None)


class StopRegexError(ValueError):
    """Why a pattern is refused (the caller names the field)."""


class StopRegexTimeout(RuntimeError):
    """The searches went over their budget: the request ends with this as its error."""


@dataclass(frozen=True)
class StopRegex:
    pattern: str
    compiled: Any  # a `regex` pattern (re's syntax), searched with a timeout
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
    except (re.error, RecursionError, OverflowError) as e:
        raise StopRegexError(f"{pattern!r} is not a valid regular expression: {e}") from None
    lo, hi = tree.getwidth()
    if lo == 0:
        raise StopRegexError(f"{pattern!r} matches the empty string: it would stop every request at once")
    if _nested_unbounded(tree, inside=False):
        raise StopRegexError(f"{pattern!r} repeats an unbounded repeat (like (a+)+), which can take exponential time")
    if (size := _expansion(tree)) > MAX_EXPANSION:
        raise StopRegexError(f"{pattern!r}: its counted repeats come to {size} copies, more than the limit of {MAX_EXPANSION}")
    if lo > WINDOW:
        raise StopRegexError(f"{pattern!r} matches only text longer than the {WINDOW} characters of output searched")
    try:
        compiled = regex.compile(pattern, regex.VERSION0)
    except (regex.error, MemoryError, RecursionError, OverflowError) as e:
        raise StopRegexError(f"{pattern!r} cannot be compiled: {e or type(e).__name__}") from None
    return StopRegex(pattern, compiled, WINDOW if hi >= _parser.MAXREPEAT else min(max(hi, 1), WINDOW))


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


def _children(op: Any, arg: Any) -> list[Any]:
    """The sub-patterns of one parsed item (a repeat's are handled by the callers)."""
    if op is _parser.SUBPATTERN:
        return [arg[-1]]
    if op is _parser.BRANCH:
        return list(arg[1])
    if op in (_parser.ASSERT, _parser.ASSERT_NOT):
        return [arg[1]]
    if op is _ATOMIC:
        return [arg]
    if op is _parser.GROUPREF_EXISTS:
        return [a for a in arg[1:] if a is not None]
    return []


def _nested_unbounded(items: Any, inside: bool) -> bool:
    """Whether an unbounded repeat sits (at any depth) inside another unbounded repeat."""
    for op, arg in items:
        if op in _REPEATS:
            _, hi, sub = arg
            unbounded = hi >= _parser.MAXREPEAT
            if (unbounded and inside) or _nested_unbounded(sub, inside or unbounded):
                return True
        elif any(_nested_unbounded(c, inside) for c in _children(op, arg)):
            return True
    return False


def _expansion(items: Any) -> int:
    """How many copies of its atoms the pattern's counted repeats make (an unbounded repeat
    counts its minimum and one more): what a compiler may unroll."""
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, sub = arg
            total += (lo + 1 if hi >= _parser.MAXREPEAT else hi) * max(_expansion(sub), 1)
        elif op is _parser.BRANCH:
            total += sum(_expansion(b) for b in arg[1])
        else:
            total += sum(_expansion(c) for c in _children(op, arg)) or 1
    return total


def find(regexes: list[StopRegex], text: str, old_len: int) -> tuple[int, str] | None:
    """The earliest end of a match that takes in text past `old_len` (what the last token added),
    and its pattern; None if no pattern matches."""
    best: tuple[int, str] | None = None
    for r in regexes:
        try:
            for m in r.compiled.finditer(text, max(0, old_len - r.window + 1), timeout=HARD_TIMEOUT_S):
                if m.end() > old_len:
                    if best is None or m.end() < best[0]:
                        best = (m.end(), r.pattern)
                    break
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {r.pattern!r}: one search of the output ran past "
                                   f"{HARD_TIMEOUT_S * 1000:g} ms (the pattern backtracks): simplify it") from None
    return best


class Searcher:
    """One request's patterns, and the CPU time their searches took (see the module's budgets)."""

    def __init__(self, regexes: list[StopRegex]) -> None:
        self.regexes = regexes
        self.spent = 0.0
        self.searches = 0

    def find(self, text: str, old_len: int) -> tuple[int, str] | None:
        t0 = time.thread_time()  # CPU time: a thread switch or a busy machine does not count against the request
        hit = find(self.regexes, text, old_len)
        self.spent += time.thread_time() - t0
        self.searches += 1
        if self.spent > max(self.searches, BUDGET_TOKENS) * MEAN_BUDGET_S:
            raise StopRegexTimeout(f"stop_regex {self.regexes[0].pattern!r}: the request's patterns took "
                                   f"{self.spent * 1000:.1f} ms of CPU over {self.searches} tokens, more than "
                                   f"{MEAN_BUDGET_S * 1000:g} ms a token (they backtrack): simplify them")
        return hit
