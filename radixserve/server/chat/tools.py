"""OpenAI tools on models whose chat template may know nothing of tools.

- The tools are described to the model in a system message (or passed to the chat template
  when it takes `tools`), with the call format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `tool_choice` "required" or a named function: the output is constrained to one call, a JSON
  object whose `name` is a tool's and whose `arguments` follow that tool's parameter schema.
- "auto": the model may answer or call; calls it emits are parsed out in the format of its chat
  template (server.chat.tool_parsers: hermes tags, and the fenced JSON Qwen2.5-Coder writes, Llama 3
  JSON, Mistral, Qwen3-Coder XML; `--tool-call-parser` overrides); a stream sends each call as
  it completes (`call_stream`).
- "none": tools are not offered.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

from radixserve.limits import TooDeep, loads
from radixserve.server.chat import harmony, tool_parsers
from radixserve.server.chat.call_stream import CallStream
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ToolCall


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False  # the call's arguments must follow the parameters exactly (as response_format's strict)


_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")


def valid_name(name: object) -> TypeGuard[str]:
    """A function name as OpenAI and Anthropic take one: 1-64 of A-Z a-z 0-9 _ -."""
    return isinstance(name, str) and 1 <= len(name) <= 64 and _NAME_CHARS.issuperset(name)


_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def parse_tools(tools: list[Any] | None) -> list[Tool]:
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}", param=f"tools[{i}]")
        for where, keys, known in ((f"tools[{i}]", t, _TOOL_KEYS), (f"tools[{i}].function", fn, _FUNCTION_KEYS)):
            unknown = sorted(set(keys) - known)
            if unknown:
                raise ApiError(400, f"{where}.{unknown[0]}: unknown field", param=f"{where}.{unknown[0]}")
        if fn.get("strict") not in (None, True, False):
            raise ApiError(400, f"tools[{i}].function.strict: expected a boolean", param=f"tools[{i}].function.strict")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not valid_name(name):
            raise ApiError(400, f"tools[{i}].function.name: {name!r} is not a valid function name", param=f"tools[{i}].function.name")
        if not isinstance(params, dict):
            where = f"tools[{i}].function.parameters"
            raise ApiError(400, f"{where}: must be a JSON schema object", param=where)
        out.append(Tool(name, str(fn.get("description", "")), params, fn.get("strict") is True))
    if len({t.name for t in out}) != len(out):
        raise ApiError(400, "tools: function names must be unique", param="tools")
    return out


def choose(tools: list[Tool], choice: Any) -> tuple[str, list[Tool]]:
    """Normalize tool_choice to (mode, tools the call may use); mode: none | auto | required."""
    if choice is None:
        return ("auto" if tools else "none"), tools
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
        return choice, tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in tools if t.name == name]
        if not named:
            raise ApiError(400, f"tool_choice.function.name: no tool is named {name!r}", param="tool_choice.function.name")
        return "required", named
    raise ApiError(400, "tool_choice: expected none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                   param="tool_choice")


def call_spec(tools: list[Tool]) -> tuple[str, bool]:
    """The constraint of a required call: (its schema, strict: whether any callable tool is)."""
    return call_schema(tools), any(t.strict for t in tools)


def call_schema(tools: list[Tool]) -> str:
    """One call to one of `tools`: {"name": <its name>, "arguments": <its parameters>}.

    Each tool's `$defs` / `definitions` move to the root `$defs` (renamed `<tool>__<name>` when
    an earlier tool took the name) and its local `$ref`s are rewritten to resolve from the root:
    `#/$defs/X` to X's new name, any other pointer (`#` itself too) into the tool's arguments."""
    defs: dict[str, Any] = {}
    branches = []
    for k, t in enumerate(tools):
        at = "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{k}/properties/arguments"
        branches.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": _hoist(t, at, defs)},
                         "required": ["name", "arguments"], "additionalProperties": False})
    root = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return json.dumps({**root, "$defs": defs} if defs else root)


def auto_tag(offered: list[Tool], fmt: str, one_call: bool = False) -> str | None:
    """tool_choice auto, constrained as vLLM's and SGLang's structural tags and llama.cpp's lazy
    grammars do it: the answer is free text until the model opens a call in its own format, and
    from there the call is held to one call of an offered tool whose arguments follow its schema
    (xgrammar's triggered tags; `one_call`: nothing after the first call). The formats:

        hermes       `<tool_call>` + {"name", "arguments"} (call_schema) + `</tool_call>`, compact
                     or on lines of its own; and the fenced call Qwen2.5-Coder writes, from
                     ```` ```json\n{\n  "name": "<tool>" ```` (an offered tool's name: a fence
                     naming another tool, or holding other JSON, stays free text), its arguments
                     pretty-printed or not
        llama3_json  `{"name": "<tool>", "parameters": ` + its schema + `}`   (xgrammar's llama tag)
        qwen3_coder  `<tool_call>\n<function=<tool>>\n` + <parameter=...> XML per its schema
                     (xgrammar's qwen_3_coder tag)

        mistral      the special token [TOOL_CALLS] (a token trigger), then a JSON list of calls
                     (call_schema items; one with `one_call`); nothing after it
        mistral_v11  [TOOL_CALLS] + an offered tool's name + the special token [ARGS] + its
                     arguments, per call
        harmony      messages on any channel, a commentary to an offered tool held to its schema
                     (harmony_tag)

    None where this xgrammar has no builtin tag for the format."""
    if not offered:
        return None
    if fmt == "harmony":
        return harmony_tag(offered, required=False)
    form = tool_parsers.FORMATS[fmt]
    if form.special_tokens:  # Mistral's
        return json.dumps({"type": "structural_tag", "format": _mistral_tags(offered, fmt, one_call)})
    if form.xgrammar_tag is not None:
        try:
            from xgrammar.builtin_structural_tag import get_model_structural_tag
        except ImportError:  # an xgrammar without builtin tags: the calls are parsed, not constrained
            return None
        specs: list[Any] = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in offered]
        tag = get_model_structural_tag(form.xgrammar_tag, tools=specs, tool_choice="auto", reasoning="disabled",
                                       max_whitespace_cnt=2, parallel_tool_calls=not one_call)
        return json.dumps(tag.model_dump(mode="json"))
    if fmt != "hermes":
        return None
    call = {"type": "json_schema", "json_schema": json.loads(call_schema(offered)), "max_whitespace_cnt": 2}
    tags = [{"type": "tag", "begin": "<tool_call>", "content": call, "end": "</tool_call>"},
            {"type": "tag", "begin": "<tool_call>\n", "content": call, "end": "\n</tool_call>"}]
    tags += [{"type": "tag", "begin": f'{_FENCE}{t.name}",\n  "arguments": ',
              "content": {"type": "json_schema", "json_schema": _hoisted(t), "max_whitespace_cnt": 6},
              "end": "\n}\n```"} for t in offered]
    fenced = [f'{_FENCE}{t.name}"' for t in offered]  # a fence engages at an offered tool's name only
    fmt_ = {"type": "triggered_tags", "triggers": ["<tool_call>", *fenced], "tags": tags, "stop_after_first": one_call}
    return json.dumps({"type": "structural_tag", "format": fmt_})


def _mistral_tags(offered: list[Tool], fmt: str, one_call: bool) -> dict[str, Any]:
    marker = {"type": "token", "token": "[TOOL_CALLS]"}
    if fmt == "mistral":  # v3: one list of calls
        root = json.loads(call_schema(offered))
        defs = root.pop("$defs", None)
        calls: dict[str, Any] = {"type": "array", "items": root, "minItems": 1, **({"maxItems": 1} if one_call else {}),
                                 **({"$defs": defs} if defs else {})}
        content: dict[str, Any] = {"type": "json_schema", "json_schema": calls, "max_whitespace_cnt": 2}
    else:  # v11: name[ARGS]{...}, each call after its own marker
        content = {"type": "or", "elements": [
            {"type": "sequence", "elements": [{"type": "const_string", "value": t.name}, {"type": "token", "token": "[ARGS]"},
                                              {"type": "json_schema", "json_schema": _hoisted(t), "max_whitespace_cnt": 2}]}
            for t in offered]}
    return {"type": "token_triggered_tags", "trigger_tokens": ["[TOOL_CALLS]"],
            "tags": [{"type": "tag", "begin": marker, "content": content, "end": ""}],
            "stop_after_first": one_call or fmt == "mistral"}


def harmony_tag(offered: list[Tool], required: bool) -> str:
    """A harmony answer (gpt-oss) with its calls held to the offered tools' schemas; xgrammar
    matches a special token by its text. An optional analysis first (the reasoning, as
    server.chat.harmony reads it), then in auto mode any messages (a preamble, the final answer,
    a call in any of the spellings gpt-oss writes), in `required` mode one call. No message's
    text holds another's markers. A call ends the answer (<|call|> is a stop token), so there is
    never more than one."""
    h = harmony
    text = {"type": "any_text", "excludes": [h.START, h.CHANNEL, h.MESSAGE]}
    calls = []
    for t in offered:
        args = {"type": "json_schema", "json_schema": _hoisted(t), "max_whitespace_cnt": 2}
        to = f"to=functions.{t.name}"
        for begin in (f"{h.CHANNEL}commentary {to} {h.CONSTRAIN}json{h.MESSAGE}",
                      f"{h.CHANNEL}commentary {to}{h.CONSTRAIN}json{h.MESSAGE}",
                      f" {to}{h.CHANNEL}commentary {h.CONSTRAIN}json{h.MESSAGE}", f" {to}{h.CHANNEL}commentary json{h.MESSAGE}"):
            calls.append({"type": "tag", "begin": begin, "content": args, "end": h.CALL})
    analysis = {"type": "tag", "begin": f"{h.CHANNEL}analysis{h.MESSAGE}", "content": text, "end": h.END}
    if required:
        rest: dict[str, Any] = {"type": "or", "elements": calls}
        alone: list[dict[str, Any]] = []
    else:
        final = {"type": "tag", "begin": h.FINAL, "content": text, "end": [h.END, h.RETURN]}
        preamble = {"type": "tag", "begin": f"{h.CHANNEL}commentary{h.MESSAGE}", "content": text, "end": h.END}
        rest = {"type": "tags_with_separator", "tags": [preamble, final, *calls], "separator": h.SEPARATOR}
        alone = [analysis]  # (an answer of reasoning only)
    then = {"type": "sequence", "elements": [analysis, {"type": "const_string", "value": h.SEPARATOR}, rest]}
    return json.dumps({"type": "structural_tag", "format": {"type": "or", "elements": [rest, then, *alone]}})


def keeps_markers(mode: str, fmt: str) -> bool:
    """Whether an answer must be decoded with its special tokens: tool calls in auto mode whose
    format marks them with special tokens (Mistral's [TOOL_CALLS], [ARGS]), which the parser
    and the call stream read; a harmony answer always (its channels are marked so)."""
    return fmt == "harmony" or (mode == "auto" and tool_parsers.FORMATS[fmt].special_tokens)


_FENCE = '```json\n{\n  "name": "'  # how Qwen2.5-Coder opens a call


def _hoisted(t: Tool) -> dict[str, Any]:
    """One tool's parameters as a standalone schema (its $defs at its root, refs resolved there)."""
    defs: dict[str, Any] = {}
    schema = _hoist(t, "#", defs)
    return {**schema, "$defs": defs} if defs else schema


def schema_field(mode: str, call_tag: bool) -> str | None:
    """The grammar field whose compile errors are the tools' schemas' (error_param, blame): a
    required call's json_schema, a call's structural tag (auto; a harmony call, required too);
    None when no call is constrained."""
    return "structural_tag" if call_tag else "json_schema" if mode == "required" else None


CHAT_PARAMS = "tools[{}].function.parameters"  # where each API keeps a tool's parameter schema
RESPONSES_PARAMS = "tools[{}].parameters"
ANTHROPIC_PARAMS = "tools[{}].input_schema"


def error_param(offered: list[Tool], callable_tools: list[Tool], where: str) -> str:
    """The field a call schema's compile error names: the one callable tool's parameters."""
    if len(callable_tools) == 1:
        return where.format(offered.index(callable_tools[0]))
    return "tools"


_ARGS = "properties/arguments"


def _args_at(msg: str) -> Iterator[tuple[int, int, int | None]]:
    """(start, end, k) of each pointer into a call's arguments in a message:
    #/properties/arguments, or #/anyOf/<k>/properties/arguments (k None for the first)."""
    i = 0
    while (s := msg.find("#/", i)) >= 0:
        j = s + 2
        if msg.startswith("anyOf/", j):
            e = d = j + len("anyOf/")
            while e < len(msg) and msg[e].isdecimal():
                e += 1
            if e > d and msg.startswith("/" + _ARGS, e):
                yield s, e + 1 + len(_ARGS), int(msg[d:e])
                i = e + 1 + len(_ARGS)
                continue
        if msg.startswith(_ARGS, j):
            yield s, j + len(_ARGS), None
            i = j + len(_ARGS)
            continue
        i = j


def blame(e: ApiError, offered: list[Tool], callable_tools: list[Tool], where: str) -> ApiError:
    """A call schema's compile error (named by error_param), naming the tool whose parameters
    hold the problem where the message points into them, with pointers as in the tool's own schema."""
    found = list(_args_at(e.message))
    if not found or e.param != error_param(offered, callable_tools, where):
        return e
    param, k = e.param, found[0][2]
    if k is not None and k < len(callable_tools):
        param = where.format(offered.index(callable_tools[k]))
    pieces, at = [], 0  # each pointer into the arguments as "#": the tool's own schema's root
    for start, end, _ in found:
        pieces += [e.message[at:start], "#"]
        at = end
    msg = "".join([*pieces, e.message[at:]])
    if msg.startswith(f"{e.param}: "):
        msg = param + msg[len(e.param):]
    return ApiError(e.status, msg, param=param, code=e.code)


_DEFS = ("$defs", "definitions")
_DATA = frozenset({"const", "enum", "default", "examples"})  # their values are JSON data, not schemas
_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", *_DEFS})  # name -> schema


def _hoist(t: Tool, at: str, defs: dict[str, Any]) -> Any:
    """The tool's parameters without their definitions, which go into `defs` (the root's)."""
    params = t.parameters
    names: dict[tuple[str, str], str] = {}  # (where, name) in the tool -> name in the root $defs
    for kind in _DEFS:
        own = params.get(kind)
        for name in own if isinstance(own, dict) else ():
            new = name if name not in defs else f"{t.name}__{name}"
            while new in defs:
                new += "_"
            names[(kind, name)] = new
            defs[new] = None  # taken
    for (kind, name), new in names.items():
        defs[new] = _refs(params[kind][name], names, at)
    moved = {kind for kind, _ in names}
    return _refs({k: v for k, v in params.items() if k not in moved}, names, at)


def _refs(s: Any, names: dict[tuple[str, str], str], at: str) -> Any:
    """A copy of schema `s` with its local `$ref`s rewritten (see call_schema)."""
    if isinstance(s, list):
        return [_refs(x, names, at) for x in s]
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k == "$ref" and isinstance(v, str):
            out[k] = _ref(v, names, at)
        elif k in _MAPS and isinstance(v, dict):
            out[k] = {n: _refs(x, names, at) for n, x in v.items()}
        else:
            out[k] = v if k in _DATA else _refs(v, names, at)
    return out


def _ref(ref: str, names: dict[tuple[str, str], str], at: str) -> str:
    if not ref.startswith("#"):
        return ref  # not local: the grammar backend refuses it, naming the tool
    parts = ref[1:].split("/")  # "#/$defs/A/properties/x" -> ["", "$defs", "A", "properties", "x"]
    key = (parts[1], parts[2].replace("~1", "/").replace("~0", "~")) if len(parts) > 2 else None
    if key in names:
        return "/".join(["#", "$defs", names[key].replace("~", "~0").replace("/", "~1"), *parts[3:]])
    return at + ref[1:]


def render(messages: list[dict[str, Any]], tools: list[Tool], template: str | None) -> tuple[list[dict[str, Any]], Any]:
    """Messages (and the `tools` argument for templates that take it) offering the tools."""
    if not tools:
        return messages, None
    specs = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
             for t in tools]
    if template and "tools" in template:
        return messages, specs
    text = ("You can call functions. To call one, reply with only "
            "<tool_call>{\"name\": <function name>, \"arguments\": <arguments as JSON>}</tool_call>\n"
            f"Functions:\n<tools>\n{json.dumps(specs)}\n</tools>")
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def calls_from_json(text: str) -> list[ToolCall]:
    """The constrained output (one JSON call) as OpenAI tool_calls; [] when the output is not a
    whole call (cut by a stop string, or with free text before it)."""
    try:
        call = json.loads(text)
        return [tool_parsers.new_call(call["name"], call["arguments"])]
    except (ValueError, RecursionError, KeyError, TypeError):  # a model's text: too deep or too long a number too
        return []


def parse_calls(text: str, tools: list[Tool], fmt: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """Tool calls the model emitted in format `fmt` (server.chat.tool_parsers); the rest stays content."""
    return tool_parsers.parse(fmt, text, tools)


def call_stream(mode: str, offered: list[Tool], fmt: str, one_call: bool) -> CallStream | None:
    """What splits a streamed answer's calls from its text as it comes: in auto mode (a required
    call is constrained JSON, parsed at the end; without tools the text is all content)."""
    return CallStream(fmt, offered, one_call) if mode == "auto" and offered and fmt != "harmony" else None


def history_text(tool_calls: list[Any] | None, param: str) -> str:
    """An assistant message's earlier tool calls, rendered back in the tagged format."""
    out = []
    for k, c in enumerate(tool_calls or []):
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", "{}")
        try:  # a JSON text (as OpenAI sends it); a JSON value was depth-checked with the body
            args = loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        except TooDeep as e:
            where = f"{param}[{k}].function.arguments"
            raise ApiError(400, f"{where}: {e}", param=where) from None
        out.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>")
    return "\n".join(out)
