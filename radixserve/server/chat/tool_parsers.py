"""Tool calls in the model's own format (`--tool-call-parser`, chosen from the chat template by
default, as llama.cpp's chat parsers and vLLM's tool parsers do). Each parser reads a finished
answer's content and returns (the content left, the calls of offered tools); a call of a tool
not offered, or one that does not parse, stays content.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2/2.5, Hermes, and
                 radixserve's own prompt for templates that know no tools); where the model
                 wrote no tags, a fenced ```json block holding only calls (Qwen2.5-Coder)
    llama3_json  Llama 3.x: an answer that is only calls, {"name": ..., "parameters": {...}},
                 after an optional <|python_tag|>, several separated by ";"
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3: Mistral 7B v0.3, Nemo), or
                 [TOOL_CALLS]name[ARGS]{...} (v11 and later: Small 3.x, Devstral, Magistral);
                 `mistral_v11` is the same parser, chosen where the template writes [ARGS] (its
                 auto-mode constraint then holds that form). The markers are special tokens: a
                 request with tools in auto mode keeps them in the decoded text (tools.keeps_markers).
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>,
                 each VALUE read by its parameter's schema type (a string as written)

`FORMATS` is the one table of them: each format's parser, the markers a stream watches for, how
its calls close, and what the auto-mode constraint (server.chat.tools) and decoding need to know.

The text is the model's, which a client can steer (its own regex, logit_bias): every reading is
linear in its length (server.text_scan), on a whole answer and on a stream (CallStream) alike.
An answer cut short by max_tokens while writing a call: see server.cut_calls."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.server.protocol import FunctionCall, ToolCall
from radixserve.server.text_scan import (
    FENCE,
    TOOL_CLOSE,
    TOOL_OPEN,
    Text,
    fenced,
    loads,
    partial_tail,
    skip_ws,
    tagged,
    xml_calls,
    xml_function,
    xml_params,
)

Parsed = tuple[str | None, list[ToolCall]]


def for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format asks for (hermes when it has none: then
    radixserve's system prompt teaches the model the tagged form)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral_v11" if "[ARGS]" in t else "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return "hermes"


@functools.lru_cache(maxsize=8)
def for_server(template: str | None, chosen: str) -> str:
    """How the model writes tool calls: `chosen` (--tool-call-parser), else (auto) its chat
    template's own format where the template takes tools (else the tagged form radixserve's tool
    prompt teaches). Mistral's parser takes the v11 form where the template writes it."""
    found = for_template(template if template and "tools" in template else None)
    return found if chosen == "auto" or (chosen == "mistral" and found == "mistral_v11") else chosen


def parse(name: str, text: str, tools: list[Any]) -> Parsed:
    """(content left or None, calls) of `text` in parser `name`'s format; `tools` the offered
    ones (`server.chat.tools.Tool`: name and parameters)."""
    return FORMATS[name].parse(text, {t.name: t for t in tools})


def new_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, json.dumps(arguments)))


def calls_of(objs: list[Any], tools: dict[str, Any], args_key: str = "arguments") -> list[ToolCall]:
    """The calls `objs` stand for, or [] unless each is a call of an offered tool with object
    arguments (`args_key`, or "arguments")."""
    out = []
    for o in objs:
        args = o.get(args_key, o.get("arguments", {})) if isinstance(o, dict) else None
        if not isinstance(o, dict) or o.get("name") not in tools or not isinstance(args, dict):
            return []
        out.append(new_call(o["name"], args))
    return out


def _cut(text: str, spans: list[tuple[int, int]]) -> str | None:
    """`text` without `spans` (in order, not overlapping), stripped."""
    pieces, at = [], 0
    for start, end in spans:
        pieces.append(text[at:start])
        at = end
    pieces.append(text[at:])
    return "".join(pieces).strip() or None


def _hermes(text: str, tools: dict[str, Any]) -> Parsed:
    calls: list[ToolCall] = []
    spans = []
    for start, end, body in tagged(text):
        found = calls_of([loads(body)], tools)
        if found:
            calls += found
            spans.append((start, end))
    if not calls:  # no tagged call: fenced blocks that hold only calls (one, or a list)
        for start, end, body in fenced(text):
            obj = loads(body)
            found = calls_of(obj if isinstance(obj, list) and obj else [obj], tools)
            if found:
                calls += found
                spans.append((start, end))
    return (_cut(text, spans), calls) if calls else (text, [])


def llama3_objects(body: str) -> tuple[list[Any], int]:
    """The JSON values at the start of `body`, separated by optional ";", and where the first
    that does not parse starts (len(body) when all do)."""
    objs: list[Any] = []
    at, decoder = 0, json.JSONDecoder()
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return objs, at
        objs.append(obj)
        at = skip_ws(body, end)
        if body.startswith(";", at):
            at = skip_ws(body, at + 1)
    return objs, at


def _llama3_json(text: str, tools: dict[str, Any]) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    objs, at = llama3_objects(body)
    calls = calls_of(objs, tools, "parameters") if objs and at == len(body) else []
    return (None, calls) if calls else (text, [])


def _mistral(text: str, tools: dict[str, Any]) -> Parsed:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker is a special token: skipped from the text, a bare list of calls is left
        obj = loads(text.strip())
        calls = calls_of(obj, tools) if isinstance(obj, list) and obj else []
        return (None, calls) if calls else (text, [])
    tail = tail.strip()
    obj = loads(tail)
    if obj is not None:  # v3: a JSON list (or one object)
        calls = calls_of(obj if isinstance(obj, list) else [obj], tools)
        return (head.strip() or None, calls) if calls else (text, [])
    calls = []  # v11: name[ARGS]{...}, one or more after the marker
    for part in tail.split("[TOOL_CALLS]"):
        name, sep, args = part.partition("[ARGS]")
        found = calls_of([{"name": name.strip(), "arguments": loads(args.strip())}], tools) if sep else []
        if not found:
            return text, []
        calls += found
    return head.strip() or None, calls


def _qwen3_coder(text: str, tools: dict[str, Any]) -> Parsed:
    calls, spans = [], []
    for start, end, function in xml_calls(text):
        f = xml_function(function)
        if f is None or f[0].strip() not in tools:
            continue
        calls.append(new_call(f[0].strip(), xml_arguments(tools[f[0].strip()], f[1])))
        spans.append((start, end))
    return (_cut(text, spans), calls) if calls else (text, [])


def xml_arguments(tool: Any, body: str) -> dict[str, Any]:
    """A Qwen3-Coder call's parameters (those whole in `body`), each read by its schema's type."""
    props = (tool.parameters or {}).get("properties", {}) if isinstance(tool.parameters, dict) else {}
    return {k.strip(): _typed(v, props.get(k.strip())) for k, v in xml_params(body)}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: a string as written, anything else as JSON where
    it parses (else the text)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


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
            if _hermes(self.text.slice(self._mark, end), self.tools)[1]:
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


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format: everything keyed by its name, in one place."""

    parse: Callable[[str, dict[str, Any]], Parsed]  # a whole answer: (content left, calls)
    markers: tuple[str, ...]  # where a call may start: a stream holds the text from there
    closes: str | None = None  # a call closes with a tag, released as it closes: read "tagged" or "xml"
    whole_answer: bool = False  # an answer may be only calls, known at its end (a stream holds it from the start)
    special_tokens: bool = False  # its markers are special tokens: decoded with them (auto mode)
    xgrammar_tag: str | None = None  # xgrammar's builtin structural tag for it (tools.auto_tag), if any


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(_hermes, (TOOL_OPEN, FENCE), closes="tagged"),
    "qwen3_coder": ToolFormat(_qwen3_coder, (TOOL_OPEN,), closes="xml", xgrammar_tag="qwen_3_coder"),
    "llama3_json": ToolFormat(_llama3_json, ("<|python_tag|>",), whole_answer=True, xgrammar_tag="llama"),
    "mistral": ToolFormat(_mistral, ("[TOOL_CALLS]",), whole_answer=True, special_tokens=True),
    "mistral_v11": ToolFormat(_mistral, ("[TOOL_CALLS]",), whole_answer=True, special_tokens=True),
}
