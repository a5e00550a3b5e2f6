r"""Linear-time scanners over text the server does not control (a model's output, a request's
fields): no backtracking regex, every position looked at a bounded number of times, whatever
the text. Each one reads exactly what the lazy regex it replaces matched (named beside it), so
valid input reads as it always did:

    tagged        <tool_call>\s*(.*?)\s*</tool_call>
    fenced        ```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```
    xml_calls     <tool_call>\s*(<function=.*?</function>)\s*</tool_call>
    xml_function  <function=([^>\n]+)>(.*?)</function>          (the first that matches)
    xml_params    <parameter=([^>\n]+)>\n?(.*?)\n?</parameter>

`Text` is a stream's growing text: appending costs the piece, reading a slice the slice (a str
grown with += is copied whole at every delta: quadratic over a long answer)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any, AnyStr

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
FENCE = "```"


class Text:
    """Append-only text read in slices (positions in characters)."""

    def __init__(self) -> None:
        self._buf = io.StringIO(newline="\n")
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, s: str) -> None:
        self._buf.seek(self._n)
        self._buf.write(s)
        self._n += len(s)

    def slice(self, a: int, b: int | None = None) -> str:
        a, b = max(a, 0), self._n if b is None else min(b, self._n)
        if b <= a:
            return ""
        self._buf.seek(a)
        return self._buf.read(b - a)

    def find(self, sub: str, a: int, b: int | None = None) -> int:
        """str.find over [a, b), read in doubling blocks: its cost is the distance to the match."""
        b = self._n if b is None else min(b, self._n)
        step = 64
        while a < b:
            hi = min(b, a + step + len(sub) - 1)
            i = self.slice(a, hi).find(sub)
            if i >= 0:
                return a + i
            if hi == b:
                break
            a, step = hi - len(sub) + 1, step * 2
        return -1

    def skip_ws(self, i: int) -> int:
        """skip_ws over this text."""
        step = 16
        while i < self._n:
            block = self.slice(i, i + step)
            rest = block.lstrip()
            if rest:
                return i + len(block) - len(rest)
            i, step = i + len(block), step * 2
        return self._n


def skip_ws(text: AnyStr, i: int, chars: AnyStr | None = None) -> int:
    """The first position at or after `i` that is not whitespace (`chars`, or str.isspace's;
    bytes: ASCII's); len(text) if none. Reads the run in doubling blocks: linear in its length."""
    step = 16
    while i < len(text):
        block = text[i:i + step]
        rest = block.lstrip(chars)
        if rest:
            return i + len(block) - len(rest)
        i += len(block)
        step *= 2
    return len(text)


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def tagged(text: str, start: int = 0) -> Iterator[tuple[int, int, str]]:
    """(start, end, body stripped) of each tagged call from `start`: an opening tag closed by the
    first closing tag after it. None after an unclosed one (no later one can close either)."""
    while (s := text.find(TOOL_OPEN, start)) >= 0:
        e = text.find(TOOL_CLOSE, s + len(TOOL_OPEN))
        if e < 0:
            return
        yield s, e + len(TOOL_CLOSE), text[s + len(TOOL_OPEN):e].strip()
        start = e + len(TOOL_CLOSE)


def fence_body(text: str, s: int) -> int:
    """Where the body of a fence opened at `s` (```, an optional json, spaces or tabs, a newline)
    starts; -1 if the line at `s` does not open one (yet)."""
    i = s + len(FENCE)
    if text.startswith("json", i):
        i += 4
    i = skip_ws(text, i, " \t")
    return i + 1 if text.startswith("\n", i) else -1


def fenced(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, body) of each ```json fence: its body without the newline and the spaces
    before the closing fence."""
    start = 0
    while (s := text.find(FENCE, start)) >= 0:
        body = fence_body(text, s)
        if body < 0:
            start = s + 1
            continue
        c = text.find(FENCE, body)
        if c < 0:
            return
        inner = text[body:c].rstrip(" \t")
        yield s, c + len(FENCE), inner[:-1] if inner.endswith("\n") else inner
        start = c + len(FENCE)


def xml_calls(text: str, start: int = 0) -> Iterator[tuple[int, int, str]]:
    """(start, end, <function=...</function>) of each Qwen3-Coder call: the first </function>
    followed (after whitespace) by </tool_call>."""
    while (s := text.find(TOOL_OPEN, start)) >= 0:
        f = skip_ws(text, s + len(TOOL_OPEN))
        if not text.startswith(FUNC_OPEN, f):
            start = s + 1
            continue
        k = f + len(FUNC_OPEN)
        while (c := text.find(FUNC_CLOSE, k)) >= 0:
            j = skip_ws(text, c + len(FUNC_CLOSE))
            if text.startswith(TOOL_CLOSE, j):
                break
            k = c + 1
        else:
            return  # no </function></tool_call> after it: none after a later one either
        yield s, j + len(TOOL_CLOSE), text[f:c + len(FUNC_CLOSE)]
        start = j + len(TOOL_CLOSE)


class _Names:
    """`<tag=NAME>` openings in one text: the nearest '>' and newline after a position, each
    found once (the callers ask about increasing positions)."""

    def __init__(self, text: str) -> None:
        self.text, self._gt, self._nl = text, -1, -1

    def name_end(self, i: int) -> int | None:
        """Where the name starting at `i` ends (at its '>'); None: no '>' after `i` at all; -1: the
        name is empty or a newline comes first."""
        t = self.text
        if self._gt < i:
            self._gt = t.find(">", i)
            if self._gt < 0:
                self._gt = len(t) + 1
        if self._gt > len(t):
            return None
        if self._nl < i:
            self._nl = t.find("\n", i)
            if self._nl < 0:
                self._nl = len(t)
        return -1 if self._gt == i or self._nl < self._gt else self._gt


def xml_function(text: str) -> tuple[str, str] | None:
    """(name, body) of the first `<function=NAME>BODY</function>`."""
    names, start = _Names(text), 0
    while (s := text.find(FUNC_OPEN, start)) >= 0:
        i = s + len(FUNC_OPEN)
        gt = names.name_end(i)
        if gt is None:
            return None
        if gt < 0:
            start = s + 1
            continue
        c = text.find(FUNC_CLOSE, gt + 1)
        return None if c < 0 else (text[i:gt], text[gt + 1:c])
    return None


def xml_params(text: str) -> list[tuple[str, str]]:
    """(name, value) of each `<parameter=NAME>VALUE</parameter>`: the value without one newline
    after the opening and one before the closing tag."""
    names, start, out = _Names(text), 0, []
    while (s := text.find(PARAM_OPEN, start)) >= 0:
        i = s + len(PARAM_OPEN)
        gt = names.name_end(i)
        if gt is None:
            break
        if gt < 0:
            start = s + 1
            continue
        v = gt + 2 if text.startswith("\n", gt + 1) else gt + 1
        c = text.find(PARAM_CLOSE, v)
        if c < 0:
            break
        out.append((text[i:gt], text[v:c - 1] if c > v and text[c - 1] == "\n" else text[v:c]))
        start = c + len(PARAM_CLOSE)
    return out


def loads(text: str) -> Any:
    """A JSON value, or None where `text` is not one (a model writes anything: too deep a
    nesting or too long a number is not JSON here either)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def cut_json(text: str, max_depth: int = 64) -> Any:
    """What a JSON text cut short says so far (as the SDKs' partial parsers read a streamed tool
    input): open arrays and objects closed, an open string as written; a key without its value,
    a number that reaches the end (it may be cut), a cut literal, whatever is not JSON and
    nesting past `max_depth` left out. None where no value started."""
    dec = json.JSONDecoder(strict=False)
    root: list[Any] = []
    stack: list[Any] = [root]  # the open containers, innermost last
    key: str | None = None  # an object's key waiting for its value
    i = skip_ws(text, 0)
    while i < len(text):
        top, c = stack[-1], text[i]
        if top is not root and key is None and c in ",]}":
            if c != ",":
                if c != ("}" if isinstance(top, dict) else "]"):
                    break
                stack.pop()
                if len(stack) == 1:
                    break
            i = skip_ws(text, i + 1)
            continue
        if isinstance(top, dict) and key is None:
            key, i = _string(text, i) if c == '"' else (None, i)
            i = skip_ws(text, i)
            if key is None or not text.startswith(":", i):
                break
            i = skip_ws(text, i + 1)
            continue
        value, i = _value(dec, text, i, len(stack) > max_depth)
        if value is _CUT:
            break
        if isinstance(top, dict):
            top[key], key = value, None
        else:
            top.append(value)
        if isinstance(value, (dict, list)):
            stack.append(value)
        elif top is root:
            break
        i = skip_ws(text, i)
    return root[0] if root else None


_CUT = object()


def _value(dec: json.JSONDecoder, text: str, i: int, too_deep: bool) -> tuple[Any, int]:
    """The value starting at `i` (an array or object: empty, to be filled) and where it ends;
    _CUT where it is cut or not JSON."""
    c = text[i]
    if c in "[{":
        return (_CUT, i) if too_deep else ([] if c == "[" else {}, i + 1)
    if c == '"':
        s, end = _string(text, i, partial=True)
        return (_CUT, i) if s is None else (s, end)
    try:
        value, end = dec.raw_decode(text, i)
    except (ValueError, RecursionError):
        return _CUT, i
    cut = end == len(text) and isinstance(value, (int, float)) and not isinstance(value, bool)
    return (_CUT, i) if cut else (value, end)


def _string(text: str, i: int, partial: bool = False) -> tuple[str | None, int]:
    """The JSON string at `i` and where it ends; cut short: what it says so far if `partial`
    (else None), and len(text)."""
    try:
        return json.decoder.scanstring(text, i + 1, False)  # type: ignore[attr-defined,no-any-return]
    except ValueError:
        if not partial:
            return None, len(text)
    raw = text[i + 1:]
    for cut in range(6):  # a cut escape at the end (a backslash, \u12) is left out
        try:
            return json.loads('"' + raw[:len(raw) - cut] + '"', strict=False), len(text)
        except ValueError:
            continue
    return None, len(text)
