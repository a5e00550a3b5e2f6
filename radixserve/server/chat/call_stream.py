"""A streamed answer's tool calls, released as each completes (`CallStream`), in any of
tool_parsers' formats: text that cannot be part of a call goes out at once, text from where a
call may start is held until it is known not to be one, and a whole answer's calls are the
ones `tool_parsers.parse` reads. Every delta is read in time linear in itself."""

from __future__ import annotations

from typing import Any

from radixserve.server.chat.text_scan import FENCE, TOOL_CLOSE, TOOL_OPEN, Text, partial_tail
from radixserve.server.chat.tool_parsers import FORMATS
from radixserve.server.protocol import ToolCall


class CallStream:
    """One streamed answer's content, split as it comes into text that cannot be part of a call
    (released at once) and whole calls (released as each completes): a tagged call (hermes,
    qwen3_coder) at its closing tag; a fenced call (hermes), a Llama 3 or a Mistral answer at
    the end, when the whole answer is parsed (`parse`, whose calls and text the stream has
    agreed with so far). Text from where a call may start (a marker, or the start of one at the
    end of the text so far) is held until it is known not to be one.

    NOTE: each delta costs work in proportion to itself: every search resumes where the last
    one stopped (the `_from` positions), and what may still be a call is read once it closes."""

    def __init__(self, fmt: str, tools: list[Any], one_call: bool) -> None:
        self.fmt, self.tools, self.one_call = fmt, {t.name: t for t in tools}, one_call
        self.format = FORMATS[fmt]
        self.text = Text()
        self.released = 0  # chars of `text` given out as content
        self.calls: list[ToolCall] = []  # given out
        self._ends = _CallEnds(self.text, self.format.closes == "xml") if self.format.closes else None
        self._first = {m: _First(self.text, m) for m in self.format.markers if m != FENCE}
        self._fences = _Fences(self.text, self.tools) if FENCE in self.format.markers else None
        self._lead = 0  # where the answer's first non-space character is (or where to look for it)
        self._seen = self._kept = 0  # text[:_seen] read for trailing spaces: its last other character ends at _kept

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now) after `text` more of the answer."""
        self.text.append(text)
        new = self._complete()
        if self.one_call:
            new = new[: max(0, 1 - len(self.calls))]
        self.calls += new
        safe = self._safe()
        out = self.text.slice(self.released, safe) if safe > self.released else ""
        self.released = max(self.released, safe)
        return out, new

    def _complete(self) -> list[ToolCall]:
        """The tagged calls closed since the last feed."""
        found: list[ToolCall] = []
        while self._ends is not None and (span := self._ends.next()) is not None:
            found += self.format.parse(self.text.slice(*span), self.tools)[1]
        return found

    def _safe(self) -> int:
        """How much of the text so far is content whatever comes next (trailing spaces held)."""
        t = self.text
        if self._may_be_all_calls():
            return 0
        cut = len(t)
        for marker in self.format.markers:
            at = self._fences.hold() if self._fences is not None and marker == FENCE else self._first[marker].at()
            cut = min(cut, at if at >= 0 else len(t) - partial_tail(t.slice(len(t) - len(marker) + 1), marker))
        return self._before_spaces(cut)

    def _may_be_all_calls(self) -> bool:
        """A Llama 3 answer that starts like a call, or a Mistral one that starts with a list."""
        if not self.format.whole_answer:
            return False
        self._lead = self.text.skip_ws(self._lead)
        head = self.text.slice(self._lead, self._lead + 15)
        if self.format.special_tokens:  # Mistral: a list of calls
            return head[:1] == "["
        return not head or head[0] == "{" or _opens(head, "<|python_tag|>")

    def _before_spaces(self, cut: int) -> int:
        """`cut` less the spaces before it. NOTE: cut only grows (each marker's hold does), so
        the text before it is read for spaces once."""
        if cut < self._seen:
            return self.released + len(self.text.slice(self.released, cut).rstrip())
        kept = self.text.slice(self._seen, cut).rstrip()
        if kept:
            self._kept = self._seen + len(kept)
        self._seen = cut
        return self._kept


class _First:
    """Where a marker first occurs in a growing text from `start` (-1: not yet), each part searched once."""

    def __init__(self, text: Text, marker: str, start: int = 0) -> None:
        self.text, self.marker, self._at, self._from = text, marker, -1, start

    def at(self) -> int:
        if self._at < 0:
            self._at = self.text.find(self.marker, self._from)
            self._from = max(self._from, len(self.text) - len(self.marker) + 1)
        return self._at


_NOT_A_CALL = -2


class _CallEnds:
    """The tagged calls of a growing text as each closes: what `tagged` (hermes) or `xml_calls`
    (qwen3_coder) finds in the whole text, found one delta at a time."""

    def __init__(self, text: Text, xml: bool) -> None:
        self.text, self.xml = text, xml
        self._open = -1  # where the call being read opens (-1: none yet)
        self._from = 0  # where reading resumes
        self._step = 0  # xml: 0 spaces then <function=, 1 looking for </function>, 2 spaces then </tool_call>
        self._close = 0  # xml: the </function> being tried

    def next(self) -> tuple[int, int] | None:
        """(start, end) of the next call that closed, or None (none yet)."""
        t = self.text
        while True:
            if self._open < 0:
                at = t.find(TOOL_OPEN, self._from)
                if at < 0:
                    self._from = max(self._from, len(t) - len(TOOL_OPEN) + 1)
                    return None
                self._open, self._from, self._step = at, at + len(TOOL_OPEN), 0
            end = self._xml_end() if self.xml else self._end()
            if end == _NOT_A_CALL:  # the next opening tag may be one
                self._open, self._from = -1, self._open + 1
                continue
            if end < 0:
                return None
            span, self._open, self._from = (self._open, end), -1, end
            return span

    def _end(self) -> int:
        e = self.text.find(TOOL_CLOSE, self._from)
        if e < 0:
            self._from = max(self._from, len(self.text) - len(TOOL_CLOSE) + 1)
            return -1
        return e + len(TOOL_CLOSE)

    def _xml_end(self) -> int:
        t = self.text
        while True:
            if self._step != 1:  # spaces, then what must come next
                self._from = t.skip_ws(self._from)
                want = "<function=" if self._step == 0 else TOOL_CLOSE
                seen = t.slice(self._from, self._from + len(want))
                if seen == want:
                    if self._step == 2:
                        return self._from + len(want)
                    self._step, self._from = 1, self._from + len(want)
                elif want.startswith(seen):  # (the start of) it, or nothing yet
                    return -1
                elif self._step == 0:
                    return _NOT_A_CALL
                else:  # this </function> is not the call's end: a later one may be
                    self._step, self._from = 1, self._close + 1
            c = t.find("</function>", self._from)
            if c < 0:
                self._from = max(self._from, len(t) - len("</function>") + 1)
                return -1
            self._step, self._close, self._from = 2, c, c + len("</function>")


class _Fences:
    """Hermes' fences in a growing text: where the text is held for one that may hold calls (a
    fence not closed yet, or one closed around calls); a closed fence that holds none is text.
    A fence: ``` and the rest of its line without a backtick, up to the next ``` (what the regex
    it replaces matched in the whole text), found one delta at a time."""

    def __init__(self, text: Text, tools: dict[str, Any]) -> None:
        self.text, self.tools = text, tools
        self._calls = -1  # a closed fence that holds calls: held from there
        self._first = _First(text, FENCE)  # the first mark after the last closed fence that held text
        self._mark, self._mark_from = -1, 0  # the mark being read as a fence's opening; where to look for one
        self._body, self._from = -1, 0  # where its body starts (-1: its opening line is not whole yet); reading resumes
        self._nl = -1  # the first newline at or after _from, once found

    def hold(self) -> int:
        """Where the first fence that may hold calls starts (-1: none)."""
        while self._calls < 0 and (end := self._closed()) >= 0:
            if FORMATS["hermes"].parse(self.text.slice(self._mark, end), self.tools)[1]:
                self._calls = self._mark
            else:
                self._mark, self._mark_from, self._first = -1, end, _First(self.text, FENCE, end)
        return self._calls if self._calls >= 0 else self._first.at()

    def _closed(self) -> int:
        """The end of the fence now being read once it closes; -1: not yet."""
        t = self.text
        while True:
            if self._mark < 0:
                self._mark = t.find(FENCE, self._mark_from)
                if self._mark < 0:
                    self._mark_from = max(self._mark_from, len(t) - len(FENCE) + 1)
                    return -1
                self._body, self._from = -1, self._mark + len(FENCE)
            if self._body < 0:  # its opening line: no backtick before the newline
                if self._nl < self._from:
                    self._nl = t.find("\n", self._from)
                end = self._nl if self._nl >= 0 else None
                if t.find("`", self._from, end) >= 0:
                    self._mark, self._mark_from = -1, self._mark + 1
                    continue
                if self._nl < 0:
                    self._from = len(t)
                    return -1
                self._body = self._from = self._nl + 1
            c = t.find(FENCE, self._from)
            if c < 0:
                self._from = max(self._body, len(t) - len(FENCE) + 1)
                return -1
            return c + len(FENCE)


def _opens(text: str, marker: str) -> bool:
    return text.startswith(marker) or marker.startswith(text)
