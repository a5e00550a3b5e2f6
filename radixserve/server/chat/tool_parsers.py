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
    harmony      gpt-oss: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...},
                 one message of its channels (server.chat.harmony, which also splits the reasoning
                 off: the analysis channel); always decoded with its special tokens

`FORMATS` is the one table of them: each format's parser, the markers a stream watches for, how
its calls close, and what the auto-mode constraint (server.chat.tools) and decoding need to know.

The text is the model's, which a client can steer (its own regex, logit_bias): every reading is
linear in its length (server.chat.text_scan), on a whole answer and on a stream (chat.call_stream) alike.
An answer cut short by max_tokens while writing a call: see server.cut_calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.server.chat import harmony
from radixserve.server.chat.text_scan import (
    FENCE,
    TOOL_OPEN,
    fenced,
    loads,
    skip_ws,
    tagged,
    xml_calls,
    xml_function,
    xml_params,
)
from radixserve.server.protocol import ToolCall, new_call

Parsed = tuple[str | None, list[ToolCall]]


def for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format asks for (hermes when it has none: then
    radixserve's system prompt teaches the model the tagged form)."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral_v11" if "[ARGS]" in t else "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return "hermes"


def for_server(template: str | None, chosen: str) -> str:
    """How the model writes tool calls: `chosen` (--tool-call-parser), else (auto) its chat
    template's own format where the template takes tools (else the tagged form radixserve's tool
    prompt teaches). Mistral's parser takes the v11 form where the template writes it."""
    found = for_template(template if template and ("tools" in template or "<|channel|>" in template) else None)
    if found == "harmony" and chosen in ("auto", "harmony"):  # its channels are its answers' form, tools or not
        return found
    return found if chosen == "auto" or (chosen == "mistral" and found == "mistral_v11") else chosen


def parse(name: str, text: str, tools: list[Any]) -> Parsed:
    """(content left or None, calls) of `text` in parser `name`'s format; `tools` the offered
    ones (`server.chat.tools.Tool`: name and parameters)."""
    return FORMATS[name].parse(text, {t.name: t for t in tools})


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
    "harmony": ToolFormat(harmony.parse, (), special_tokens=True),  # read by its splitter (reasoning.splitter)
}
