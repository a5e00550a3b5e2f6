"""A call the answer was writing when max_tokens cut it: returned as a call, its arguments as
written so far (not valid JSON), as OpenAI and Anthropic return a call their limit cut (with
finish_reason "length" / stop_reason "max_tokens" / a Responses answer incomplete), never as
the answer's text, which a client would take for a final answer.

    required     the whole output is the call: {"name": ..., "arguments": ...
    hermes       <tool_call>{"name": ..., "arguments": ...   (or a ```json fence)
    qwen3_coder  <tool_call><function=NAME><parameter=...      (the whole parameters, as JSON
                 without its closing brace)
    mistral      [TOOL_CALLS][{...}, {"name": ...   and   [TOOL_CALLS]name[ARGS]{...
    llama3_json  [<|python_tag|>] {...}; {"name": ..., "parameters": ...

A call whose name is not whole yet is dropped where the text marks it as a call (the required
JSON, a <tool_call> tag, [TOOL_CALLS], <|python_tag|>): OpenAI never returns a call without a
name, and the markup is not an answer either; unmarked (a fence, a bare Llama 3 object) it stays
text. A call of a tool not offered, or that does not read as one, stays text, as a whole one
would. Each reading is linear in the text."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.server.chat.text_scan import (
    FENCE,
    FUNC_CLOSE,
    FUNC_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    fence_body,
    fenced,
    loads,
    skip_ws,
)
from radixserve.server.chat.tool_parsers import calls_of, llama3_objects, xml_arguments
from radixserve.server.protocol import FunctionCall, ToolCall

Cut = tuple[str | None, list[ToolCall], bool]  # (content left, calls, whether the last call is cut short)


@dataclass(frozen=True)
class _Found:
    """What the text at the end of an answer is: a call (`cut`: its arguments are cut short, else
    only the markup after them), a marked call whose name was cut (`drop`), or text (neither)."""

    call: ToolCall | None = None
    cut: bool = True
    drop: bool = False


_TEXT, _DROP = _Found(), _Found(drop=True)


def required(text: str, tools: list[Any]) -> Cut:
    """A required call (the constrained JSON) cut short."""
    return _after(text, 0, [], _json_call(text, {t.name: t for t in tools}, ("arguments",), marked=True))


def in_format(fmt: str, text: str | None, tools: list[Any]) -> Cut:
    """The calls at the end of an auto-mode answer cut short, in format `fmt` (tool_parsers),
    `text` the content left once its whole calls were read (tool_parsers.parse)."""
    if text is None:
        return None, [], False
    by_name = {t.name: t for t in tools}
    if fmt == "hermes":
        return _hermes(text, by_name)
    if fmt == "qwen3_coder":
        return _qwen3_coder(text, by_name)
    if fmt in ("mistral", "mistral_v11"):
        return _mistral(text, by_name)
    return _llama3_json(text, by_name)


def call_prefix(text: str, keys: tuple[str, ...] = ("arguments",)) -> tuple[str | None, str] | None:
    """(name, arguments as written so far) of a JSON call cut short, {"name": ..., "<key>": ...;
    name None while its string is cut; None where `text` does not start like a call."""
    i = _expect(text, skip_ws(text, 0), ("{", '"name"', ":"))
    if i is None or (i < len(text) and text[i] != '"'):
        return None
    if i == len(text):
        return None, ""
    try:
        name, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
    except ValueError:  # cut inside the name
        return None, ""
    i = _expect(text, skip_ws(text, i), (",",))
    if i is None:
        return None
    for key in keys:
        j = _expect(text, i, (f'"{key}"', ":"))
        if j is not None:
            return name, text[j:]
    return None


def _expect(text: str, i: int, lits: tuple[str, ...]) -> int | None:
    """Where `lits` end (spaces after each skipped): len(text) if the text ends inside them,
    None if they are not there."""
    for lit in lits:
        if text.startswith(lit, i):
            i = skip_ws(text, i + len(lit))
        elif lit.startswith(text[i:]):
            return len(text)
        else:
            return None
    return i


def _call(name: str, arguments: str, cut: bool = True) -> _Found:
    return _Found(ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, arguments)), cut)


def _json_call(text: str, tools: dict[str, Any], keys: tuple[str, ...], marked: bool) -> _Found:
    """A JSON call at the end of an answer (`marked`: the text says it is a call)."""
    whole = calls_of([loads(text)], tools, keys[0])  # only its closing tag or fence was cut
    if whole:
        return _Found(whole[0], cut=False)
    found = call_prefix(text, keys)
    if found is None:
        return _TEXT
    name, arguments = found
    if name is None:
        return _DROP if marked else _TEXT
    return _call(name, arguments) if name in tools else _TEXT


def _after(text: str, at: int, calls: list[ToolCall], found: _Found) -> Cut:
    """The result where what `found` is starts at `at`, after the whole `calls`."""
    if found.call is None and not found.drop:  # text
        return text, [], False
    head = text[:at].strip() or None
    return (head, [*calls, found.call], found.cut) if found.call is not None else (head, calls, False)


def _hermes(text: str, tools: dict[str, Any]) -> Cut:
    at = text.rfind(TOOL_OPEN)
    if at >= 0 and text.find(TOOL_CLOSE, at) < 0:
        return _after(text, at, [], _json_call(text[at + len(TOOL_OPEN):], tools, ("arguments",), marked=True))
    closed = [end for _, end, _ in fenced(text)]  # a fence not closed: after the last closed one
    at = text.find(FENCE, closed[-1] if closed else 0)
    while at >= 0 and (body := fence_body(text, at)) < 0:
        at = text.find(FENCE, at + 1)
    if at < 0:
        return text, [], False
    return _after(text, at, [], _json_call(text[body:], tools, ("arguments",), marked=False))


def _qwen3_coder(text: str, tools: dict[str, Any]) -> Cut:
    at = text.rfind(TOOL_OPEN)
    if at < 0 or text.find(TOOL_CLOSE, at) >= 0:
        return text, [], False
    rest = text[at + len(TOOL_OPEN):]
    i = skip_ws(rest, 0)
    if not rest.startswith(FUNC_OPEN, i):
        return _after(text, at, [], _DROP if FUNC_OPEN.startswith(rest[i:]) else _TEXT)
    i += len(FUNC_OPEN)
    gt = rest.find(">", i)
    if rest.find("\n", i, gt if gt >= 0 else len(rest)) >= 0 or gt == i:
        return text, [], False  # not a name
    name = rest[i:gt].strip() if gt >= 0 else None
    if name is None or name not in tools:
        return _after(text, at, [], _DROP if name is None else _TEXT)
    body = rest[gt + 1:]
    close = body.find(FUNC_CLOSE)  # the parameters are whole: only </tool_call> was cut
    args = json.dumps(xml_arguments(tools[name], body if close < 0 else body[:close]))
    return _after(text, at, [], _call(name, args[:-1]) if close < 0 else _call(name, args, cut=False))


def _mistral(text: str, tools: dict[str, Any]) -> Cut:
    head, marker, tail = text.partition("[TOOL_CALLS]")
    if not marker:
        return text, [], False
    at, body = len(head), tail.lstrip()
    if body[:1] not in ("[", "{"):
        return _mistral_v11(text, at, body, tools)
    i, calls, decoder = (1 if body[:1] == "[" else 0), [], json.JSONDecoder()  # v3: a list of calls, the last cut
    while True:
        i = skip_ws(body, i)
        try:
            obj, end = decoder.raw_decode(body, i)
        except (ValueError, RecursionError):
            break
        found = calls_of([obj], tools)
        if not found:
            return text, [], False
        calls += found
        i = skip_ws(body, end)
        if i == len(body):  # cut after a whole call
            return head.strip() or None, calls, False
        if not body.startswith(",", i):
            return text, [], False
        i += 1
    return _after(text, at, calls, _json_call(body[i:], tools, ("arguments",), marked=True))


def _mistral_v11(text: str, at: int, body: str, tools: dict[str, Any]) -> Cut:
    """name[ARGS]{...} after each marker, the last cut."""
    calls: list[ToolCall] = []
    *whole, last = body.split("[TOOL_CALLS]")
    for part in whole:
        name, sep, args = part.partition("[ARGS]")
        found = calls_of([{"name": name.strip(), "arguments": loads(args.strip())}], tools) if sep else []
        if not found:
            return text, [], False
        calls += found
    name, sep, args = last.partition("[ARGS]")
    if not sep or name.strip() not in tools:
        return _after(text, at, calls, _TEXT if sep else _DROP)
    return _after(text, at, calls, _call(name.strip(), args.lstrip()))


def _llama3_json(text: str, tools: dict[str, Any]) -> Cut:
    stripped = text.strip()
    body = stripped.removeprefix("<|python_tag|>").strip()
    objs, at = llama3_objects(body)
    calls = calls_of(objs, tools, "parameters") if objs else []
    if len(calls) < len(objs):
        return text, [], False
    marked = bool(calls) or stripped.startswith("<|python_tag|>")
    return _after(text, 0, calls, _json_call(body[at:], tools, ("parameters", "arguments"), marked))
