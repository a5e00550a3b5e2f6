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
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from radixserve.server.protocol import FunctionCall, ToolCall

Parsed = tuple[str | None, list[ToolCall]]

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.S)
_ANY_FENCE = re.compile(r"```[^\n`]*\n.*?```", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_XML_CALL = re.compile(r"<tool_call>\s*(<function=.*?</function>)\s*</tool_call>", re.S)


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


def parse(name: str, text: str, tools: list[Any]) -> Parsed:
    """(content left or None, calls) of `text` in parser `name`'s format; `tools` the offered
    ones (`server.tools.Tool`: name and parameters)."""
    return _BY_NAME[name](text, {t.name: t for t in tools})


def new_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, json.dumps(arguments)))


def _calls(objs: list[Any], tools: dict[str, Any], args_key: str = "arguments") -> list[ToolCall]:
    """The calls `objs` stand for, or [] unless each is a call of an offered tool with object
    arguments (`args_key`, or "arguments")."""
    out = []
    for o in objs:
        args = o.get(args_key, o.get("arguments", {})) if isinstance(o, dict) else None
        if not isinstance(o, dict) or o.get("name") not in tools or not isinstance(args, dict):
            return []
        out.append(new_call(o["name"], args))
    return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _cut(text: str, spans: list[tuple[int, int]]) -> str | None:
    for start, end in reversed(spans):
        text = text[:start] + text[end:]
    return text.strip() or None


def _hermes(text: str, tools: dict[str, Any]) -> Parsed:
    calls: list[ToolCall] = []
    spans = []
    for m in _TAGGED.finditer(text):
        found = _calls([_json(m.group(1))], tools)
        if found:
            calls += found
            spans.append(m.span())
    if not calls:  # no tagged call: fenced blocks that hold only calls (one, or a list)
        for m in _FENCED.finditer(text):
            obj = _json(m.group(1))
            found = _calls(obj if isinstance(obj, list) and obj else [obj], tools)
            if found:
                calls += found
                spans.append(m.span())
    return (_cut(text, spans), calls) if calls else (text, [])


def _llama3_json(text: str, tools: dict[str, Any]) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    objs, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        objs.append(obj)
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(body) - len(rest)
    calls = _calls(objs, tools, "parameters") if objs else []
    return (None, calls) if calls else (text, [])


def _mistral(text: str, tools: dict[str, Any]) -> Parsed:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker is a special token: skipped from the text, a bare list of calls is left
        obj = _json(text.strip())
        calls = _calls(obj, tools) if isinstance(obj, list) and obj else []
        return (None, calls) if calls else (text, [])
    tail = tail.strip()
    obj = _json(tail)
    if obj is not None:  # v3: a JSON list (or one object)
        calls = _calls(obj if isinstance(obj, list) else [obj], tools)
        return (head.strip() or None, calls) if calls else (text, [])
    calls = []  # v11: name[ARGS]{...}, one or more after the marker
    for part in tail.split("[TOOL_CALLS]"):
        name, sep, args = part.partition("[ARGS]")
        found = _calls([{"name": name.strip(), "arguments": _json(args.strip())}], tools) if sep else []
        if not found:
            return text, []
        calls += found
    return head.strip() or None, calls


def _qwen3_coder(text: str, tools: dict[str, Any]) -> Parsed:
    calls, spans = [], []
    for m in _XML_CALL.finditer(text):
        f = _FUNCTION.search(m.group(1))
        if f is None or f.group(1).strip() not in tools:
            continue
        tool = tools[f.group(1).strip()]
        props = (tool.parameters or {}).get("properties", {}) if isinstance(tool.parameters, dict) else {}
        args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in _PARAMETER.findall(f.group(2))}
        calls.append(new_call(tool.name, args))
        spans.append(m.span())
    return (_cut(text, spans), calls) if calls else (text, [])


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: a string as written, anything else as JSON where
    it parses (else the text)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class CallStream:
    """One streamed answer's content, split as it comes into text that cannot be part of a call
    (released at once) and whole calls (released as each completes): a tagged call (hermes,
    qwen3_coder) at its closing tag; a fenced call (hermes), a Llama 3 or a Mistral answer at
    the end, when the whole answer is parsed (`parse`, whose calls and text the stream has
    agreed with so far). Text from where a call may start (a marker, or the start of one at the
    end of the text so far) is held until it is known not to be one."""

    _MARKERS = {"hermes": ("<tool_call>", "```"), "qwen3_coder": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                "mistral_v11": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",)}

    def __init__(self, fmt: str, tools: list[Any], one_call: bool) -> None:
        self.fmt, self.tools, self.one_call = fmt, {t.name: t for t in tools}, one_call
        self.text = ""
        self.released = 0  # chars of `text` given out as content
        self.calls: list[ToolCall] = []  # given out
        self._scanned = 0  # where the next tagged call may start (the end of the last one)
        self._fences = 0  # where the next fence may start (the end of the last closed one, which held text)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now) after `text` more of the answer."""
        self.text += text
        new = self._complete()
        if self.one_call:
            new = new[: max(0, 1 - len(self.calls))]
        self.calls += new
        safe = self._safe()
        out = self.text[self.released : safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return out, new

    def _complete(self) -> list[ToolCall]:
        """The tagged calls closed since the last feed."""
        if self.fmt not in ("hermes", "qwen3_coder"):
            return []
        found = []
        for m in (_TAGGED if self.fmt == "hermes" else _XML_CALL).finditer(self.text, self._scanned):
            found += _BY_NAME[self.fmt](m.group(0), self.tools)[1]
            self._scanned = m.end()
        return found

    def _safe(self) -> int:
        """How much of the text so far is content whatever comes next (trailing spaces held)."""
        t = self.text
        head = t.lstrip()
        if self.fmt == "llama3_json" and (not head or head[0] == "{" or _opens(head, "<|python_tag|>")):
            return 0  # an answer that may be all calls
        if self.fmt in MISTRAL and head[:1] == "[":
            return 0
        cut = len(t)
        for marker in self._MARKERS[self.fmt]:
            at = t.find(marker)
            if marker == "```":  # a closed fence that holds no calls is text
                at = self._open_fence()
            cut = min(cut, at if at >= 0 else len(t) - partial_tail(t, marker))
        return len(t[:cut].rstrip())

    def _open_fence(self) -> int:
        """Where the first fence that may hold calls starts: one not closed yet, or closed around
        calls (-1: none)."""
        for m in _ANY_FENCE.finditer(self.text, self._fences):
            if _hermes(m.group(0), self.tools)[1]:
                return m.start()
            self._fences = m.end()
        return self.text.find("```", self._fences)


def _opens(text: str, marker: str) -> bool:
    return text.startswith(marker) or marker.startswith(text)


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


MISTRAL = ("mistral", "mistral_v11")
_BY_NAME: dict[str, Callable[[str, dict[str, Any]], Parsed]] = {
    "hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "mistral_v11": _mistral, "qwen3_coder": _qwen3_coder}
