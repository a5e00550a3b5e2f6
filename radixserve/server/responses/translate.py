"""A Responses request in chat terms (`translate`: the chat core's Turn): its input items as
chat messages, its flat function tools and tool_choice as the chat path's (server/chat/tools.py),
text.format as a JSON schema, a continuation's stored conversation; and the input items as
/input_items lists them. Every error names the Responses field.

A reasoning item sent back (as a client managing its own context does) is dropped from the
prompt: an earlier turn's reasoning is not shown to the model again, as reasoning models'
templates drop it."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.request import Retention
from radixserve.server.chat import tools
from radixserve.server.chat.core import Call, Plan, Rendered, Sampling, Turn
from radixserve.server.errors import ApiError
from radixserve.server.responses.protocol import CreateResponseRequest, InputItem, InputPart, ResponseObject, TextConfig
from radixserve.server.responses.stored import STORE, db, not_found
from radixserve.server.state import RequestOptions

ROLES = ("user", "assistant", "system", "developer")
RENAME = {"max_new_tokens": "max_output_tokens", "prompt": "input", "input_ids": "input", "json_schema": "text.format"}


# -- the request -> the chat core's turn -----------------------------------------------------
@dataclass
class Pending:
    """What a Responses reply fills in: the response begun, its reasoning item's and message's
    ids (known before their text is), and for a stored turn the conversation it continues
    (without the instructions) and the input items as /input_items lists them."""

    resp: ResponseObject
    ids: tuple[str, str]
    conversation: list[dict[str, Any]]
    items: bytes | None


async def translate(call: Call) -> Turn:
    """The chat core's turn of a Responses request; a continuation (previous_response_id) goes
    on from its stored context: its conversation after the instructions, its prompt and output
    tokens reused as the rendering's prefix where the new text starts with them."""
    b: CreateResponseRequest = call.body
    plan, sampling = plan_of(b, call.state.tool_format)
    prev = None
    if b.previous_response_id is not None:
        row = await db(call.request, call.request.app[STORE].get, call.tenant.owner, b.previous_response_id)
        if row is None:
            raise not_found(b.previous_response_id, "previous_response_id")
        prev = row.loaded_context()
    at = 1 if b.instructions else 0  # the instructions are this request's own: a stored turn keeps the rest
    if prev is not None:
        plan.messages[at:at] = prev.messages
    opts = RequestOptions(rename=RENAME, prompt_cache_key=b.prompt_cache_key,  # a routing hint, as in chat
                          retention=Retention.named(b.prompt_cache_retention, "prompt_cache_retention"))
    items = msgspec.json.encode(listed_items(b.input)) if b.store else None
    pending = Pending(new_response(call.state.answered_by(b.model), b), (new_id("rs"), new_id("msg")), plan.messages[at:], items)
    return Turn(plan, sampling, opts, None if prev is None else (prev.text, prev.ids), Rendered(), data=pending)


def plan_of(b: CreateResponseRequest, tool_format: str = "hermes") -> tuple[Plan, Sampling]:
    """The request checked, as a plan (the instructions first) and its sampling, before the
    stored context it may continue (translate) and the core's constraint (chat_core.prepare)."""
    if b.max_output_tokens is not None and b.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens: must be at least 1, got {b.max_output_tokens}", param="max_output_tokens")
    if b.top_logprobs:
        raise ApiError(400, "top_logprobs: logprobs are not supported on /v1/responses", param="top_logprobs")
    if b.background:
        raise ApiError(400, "background: background responses are not supported", param="background")
    schema = text_schema(b.text)
    offered = parse_tools(b.tools)
    mode, callable_tools = choose(offered, b.tool_choice)
    if mode == "required" and schema is not None:
        raise ApiError(400, "text.format: cannot be combined with a required tool call", param="text.format")
    kwargs = {"enable_thinking": False} if (b.reasoning or {}).get("effort") == "none" else {}
    system = [{"role": "system", "content": b.instructions}] if b.instructions else []
    plan = Plan([*system, *to_messages(b.input)], tools.RESPONSES_PARAMS, offered, mode, callable_tools, schema,
                tool_format=tool_format, one_call=b.parallel_tool_calls is False, template_kwargs=kwargs)
    return plan, Sampling(max_tokens=b.max_output_tokens, temperature=b.temperature, top_p=b.top_p)


def new_response(model: str, b: CreateResponseRequest) -> ResponseObject:
    return ResponseObject(
        id=new_id("resp"), created_at=int(time.time()), model=model, status="in_progress", output=[],
        instructions=b.instructions, tools=b.tools or [], tool_choice=b.tool_choice or "auto", text=echo_text(b.text),
        temperature=1.0 if b.temperature is None else b.temperature, top_p=1.0 if b.top_p is None else b.top_p,
        max_output_tokens=b.max_output_tokens, previous_response_id=b.previous_response_id, metadata=b.metadata or {},
        parallel_tool_calls=b.parallel_tool_calls is not False, store=b.store, user=b.user,
        truncation=b.truncation or "disabled")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# -- input -> chat messages ------------------------------------------------------------------
def to_messages(value: str | list[InputItem]) -> list[dict[str, Any]]:
    if not value:
        raise _bad("input", "must not be empty")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if item.type == "message":
            out.append(_message(i, item))
        elif item.type == "function_call":
            call = _call_text(i, item)
            if out and out[-1]["role"] == "assistant":  # the calls of one turn join its text, as chat renders them
                out[-1]["content"] = "\n".join(x for x in (out[-1]["content"], call) if x)
            else:
                out.append({"role": "assistant", "content": call})
        elif item.type == "function_call_output":
            _need(i, item, "call_id", "output")
            out.append({"role": "tool", "content": _text(item.output, f"input[{i}].output")})
        elif item.type != "reasoning":
            raise _bad(f"input[{i}].type",
                       f"{item.type!r} is not one of message, function_call, function_call_output, reasoning")
    if not out:
        raise _bad("input", "must hold a message or a function call, not only reasoning")
    return out


def _need(i: int, item: InputItem, *fields: str) -> None:
    for f in fields:
        if getattr(item, f) is None:
            raise _bad(f"input[{i}].{f}", f"required for a {item.type} item")


def _message(i: int, item: InputItem) -> dict[str, Any]:
    _need(i, item, "role", "content")
    if item.role not in ROLES:
        raise _bad(f"input[{i}].role", f"{item.role!r} is not one of {', '.join(ROLES)}")
    role = "system" if item.role == "developer" else item.role
    return {"role": role, "content": _text(item.content, f"input[{i}].content")}


def _text(content: str | list[InputPart] | None, param: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise _bad(f"{param}[{j}].type", f"only input_text and output_text parts are supported, got {part.type!r}")
        if part.text is None:
            raise _bad(f"{param}[{j}].text", f"an {part.type} part needs its text")
    return "".join(p.text or "" for p in content)


def _call_text(i: int, item: InputItem) -> str:
    """An earlier function call, rendered back the way the chat path renders tool calls."""
    _need(i, item, "call_id", "name", "arguments")
    try:
        return tools.history_text([{"function": {"name": item.name, "arguments": item.arguments}}], f"input[{i}]")
    except ApiError as e:
        raise _bad(f"input[{i}].arguments", e.message.split(": ", 1)[-1]) from None


# -- input -> the items /input_items lists ---------------------------------------------------
def listed_items(value: str | list[InputItem]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [_listed_message(new_id("msg"), "user", value)]
    out = []
    for item in value:
        if item.type == "message":
            out.append(_listed_message(item.id or new_id("msg"), item.role or "user", _text(item.content, "input")))
        elif item.type == "function_call":
            out.append({"type": "function_call", "id": item.id or new_id("fc"), "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments, "status": "completed"})
        elif item.type == "reasoning":
            parts = item.content if isinstance(item.content, list) else []
            out.append({"type": "reasoning", "id": item.id or new_id("rs"), "summary": item.summary or [],
                        "content": [{"type": "reasoning_text", "text": p.text or ""} for p in parts]})
        else:
            out.append({"type": "function_call_output", "id": item.id or new_id("fco"), "call_id": item.call_id,
                        "output": _text(item.output, "input"), "status": "completed"})
    return out


def _listed_message(mid: str, role: str, text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []} if role == "assistant" else {"type": "input_text", "text": text}
    return {"type": "message", "id": mid, "role": role, "status": "completed", "content": [part]}


# -- tools, tool_choice, text.format ---------------------------------------------------------
def parse_tools(raw: list[dict[str, Any]] | None) -> list[tools.Tool]:
    """Responses tools are flat ({type, name, description, parameters, strict}): checked by the
    chat path's parse_tools in its nested shape, its errors renamed to the flat fields."""
    nested = []
    for i, t in enumerate(raw or []):
        if t.get("type") != "function":
            raise _bad(f"tools[{i}].type", f"only function tools are supported, got {t.get('type')!r}")
        fn = {k: v for k, v in t.items() if k != "type" and v is not None}  # unknown keys: a 400 from parse_tools
        nested.append({"type": "function", "function": fn})
    try:
        return tools.parse_tools(nested)
    except ApiError as e:
        param = e.param.replace(".function.", ".") if e.param else None
        raise ApiError(e.status, e.message.replace(".function.", "."), param=param) from None


def choose(offered: list[tools.Tool], choice: str | dict[str, Any] | None) -> tuple[str, list[tools.Tool]]:
    """(mode, tools a call may use), mode none | auto | required, as the chat path's choose."""
    if isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "name": ...}')
        named = [t for t in offered if t.name == name]
        if not named:
            raise _bad("tool_choice.name", f"no tool is named {name!r}")
        return "required", named
    if choice not in (None, "none", "auto", "required"):
        raise _bad("tool_choice", f'{choice!r} is not one of "none", "auto", "required" or {{"type": "function", "name": ...}}')
    if not offered and choice != "required":
        return "none", []
    return tools.choose(offered, choice)


def text_schema(text: TextConfig | None) -> tuple[str, bool] | None:
    """text.format as (JSON schema text, strict), or None for free text: what chat's
    response_format becomes, so both constrain (and refuse what they cannot enforce) alike."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"}), False
    if fmt.schema is None:
        raise _bad("text.format.schema", "required when text.format.type is json_schema")
    return json.dumps(fmt.schema), fmt.strict is True


def echo_text(text: TextConfig | None) -> dict[str, Any]:
    fmt = text.format if text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    echoed: dict[str, Any] = {"type": fmt.type}
    if fmt.type == "json_schema":
        echoed.update(name=fmt.name or "response", schema=fmt.schema, strict=fmt.strict is True)
        if fmt.description is not None:
            echoed["description"] = fmt.description
    return {"format": echoed}
