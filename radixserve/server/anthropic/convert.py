"""Anthropic requests as a chat.core Plan and sampling parameters; engine outputs as Anthropic
content blocks, stop reasons and usage.

- tool_use blocks (an assistant's earlier calls) become the tool-call history text the chat
  path renders (tools.history_text); each tool_result block becomes a "tool" message.
- A final assistant turn of text is a prefill: its tokens follow the generation prompt and the
  answer continues it (as Anthropic's API does).
- tool_choice any/tool constrain the output to one call (chat_core.constrain); auto parses calls
  out of free text; none offers no tools. output_config.format constrains it to a JSON schema.
- With --reasoning-parser the output's `<think>` part is a leading thinking block and the text
  and tool_use blocks come from the rest (server/chat/reasoning.py, as chat's reasoning_content); a
  constraint applies after the reasoning. `thinking` disabled sets enable_thinking=false in the
  template (no split); enabled (budget_tokens checked as Anthropic does, then only a hint) or
  adaptive keep the model's thinking. Thinking blocks sent back are left out of the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.engine.outputs import Output
from radixserve.server.anthropic.protocol import (
    Block,
    ContentBlock,
    CountTokensRequest,
    DocumentBlockParam,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlockParam,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ThinkingConfig,
    ToolChoice,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from radixserve.server.chat import core as chat_core
from radixserve.server.chat import reasoning, tools
from radixserve.server.chat.core import Plan
from radixserve.server.chat.text_scan import cut_json, loads
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ToolCall
from radixserve.server.state import RequestOptions

# engine field names -> this API's
RENAME = {"max_new_tokens": "max_tokens", "prompt": "messages", "stop": "stop_sequences",
          "json_schema": "output_config.format.schema"}


def bad(where: str, problem: str) -> ApiError:
    return ApiError(400, f"{where}: {problem}", param=where)


def conversation(b: CountTokensRequest, reasoning_parser: str | None = None, tool_format: str = "hermes") -> Plan:
    """The request as a plan: its messages (a final assistant turn of text is the prefill), its
    tools, its thinking, and output_config.format as the schema (refused beside a required call
    by engine_request: counting tokens does not constrain)."""
    if not b.messages:
        raise bad("messages", "must contain at least one message")
    for i, m in enumerate(b.messages):  # as Anthropic's API: user and assistant only, a user turn first
        if m.role not in ("user", "assistant"):
            raise bad(f"messages[{i}].role", f"must be \"user\" or \"assistant\", got {m.role!r} (a system prompt goes in system)")
    if b.messages[0].role != "user":
        raise bad("messages[0].role", "the first message must use the \"user\" role")
    parser = "harmony" if tool_format == "harmony" else reasoning_parser  # a harmony answer's analysis is its reasoning
    plan = Plan([], tools.ANTHROPIC_PARAMS, template_kwargs=_thinking(b.thinking, parser), tool_format=tool_format)
    if b.system:
        plan.messages.append({"role": "system", "content": _text(b.system, "system")})
    for i, m in enumerate(b.messages):
        plan.messages.extend(_turn(m, f"messages[{i}]"))
    last = b.messages[-1]
    if last.role == "assistant" and not _has_calls(last):
        plan.prefill = plan.messages.pop()["content"]
    plan.offered = _tools(b.tools)
    plan.mode, plan.callable = _choose(plan.offered, b.tool_choice)
    plan.one_call = bool(b.tool_choice and b.tool_choice.disable_parallel_tool_use)
    fmt = b.output_config.format if b.output_config is not None else None
    plan.schema = (json.dumps(fmt.schema), True) if fmt is not None else None
    return plan


def _thinking(t: ThinkingConfig | None, parser: str | None) -> dict[str, Any]:
    """The template's variables for `thinking`. Omitted: the model's own default, its reasoning
    split off when a parser is set."""
    if t is None or t.type == "disabled":
        return {"enable_thinking": False} if t is not None else {}
    if parser is None:
        raise bad("thinking", f"type {t.type!r} needs a reasoning model: start the server with --reasoning-parser "
                  "(qwen3 or deepseek_r1), or omit thinking or send {\"type\": \"disabled\"}")
    n = t.budget_tokens
    if t.type == "enabled" and (n is None or n < 1024):
        raise bad("thinking.budget_tokens", "required when thinking.type is \"enabled\"" if n is None
                  else f"must be at least 1024, got {n}")
    if t.type != "enabled" and n is not None:
        raise bad("thinking.budget_tokens", "only allowed when thinking.type is \"enabled\"")
    return {"enable_thinking": True} if t.type == "enabled" else {}


def shows_thinking(b: CountTokensRequest) -> bool:
    """thinking.display "omitted": the thinking block's text is left empty."""
    return b.thinking is None or b.thinking.display != "omitted"


def _has_calls(m: MessageParam) -> bool:
    return isinstance(m.content, list) and any(isinstance(x, ToolUseBlockParam) for x in m.content)


def _text(content: str | list[Any], where: str) -> str:
    """Text blocks (or a string) as one text; any other block is refused by name."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if not isinstance(block, TextBlockParam):
            _refuse(block, f"{where}[{j}]", "only text blocks are allowed here")
    return "".join(block.text for block in content)


def _refuse(block: Block, where: str, otherwise: str) -> None:
    if isinstance(block, (ImageBlockParam, DocumentBlockParam)):
        kind = "image" if isinstance(block, ImageBlockParam) else "document"
        raise bad(f"{where}.type", f"{kind} blocks are not supported: the served model reads text only")
    raise bad(f"{where}.type", f"{type(block).__struct_config__.tag!r}: {otherwise}")


def _turn(m: MessageParam, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results are "tool" messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        return [_assistant(m.content, where)]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(m.content):
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ToolResultBlockParam) and m.role == "user":
            if text:
                out.append({"role": m.role, "content": "".join(text)})
                text = []
            out.append({"role": "tool", "content": _result(block, f"{where}.content[{j}]")})
        else:
            _refuse(block, f"{where}.content[{j}]", f"not allowed in a {m.role} message")
    if text or not out:
        out.append({"role": m.role, "content": "".join(text)})
    return out


def _assistant(blocks: list[Block], where: str) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            text.append(block.text)
        elif isinstance(block, ToolUseBlockParam):
            calls.append({"function": {"name": block.name, "arguments": block.input}})
        elif not isinstance(block, (ThinkingBlockParam, RedactedThinkingBlockParam)):  # earlier thinking: dropped
            _refuse(block, f"{where}.content[{j}]", "not allowed in an assistant message")
    history = tools.history_text(calls, f"{where}.content")
    return {"role": "assistant", "content": "\n".join(x for x in ("".join(text), history) if x)}


def _result(block: ToolResultBlockParam, where: str) -> str:
    text = _text(block.content, f"{where}.content")
    return f"Error: {text}" if block.is_error else text


def _tools(specs: list[ToolParam] | None) -> list[tools.Tool]:
    out = []
    for i, t in enumerate(specs or []):
        where = f"tools[{i}]"
        if t.type not in (None, "custom"):
            raise bad(f"{where}.type", f"{t.type!r} is not supported; only custom tools (name, description, input_schema) are")
        if not tools.valid_name(t.name):
            raise bad(f"{where}.name", f"{t.name!r} is not a valid tool name (1-64 of A-Z a-z 0-9 _ -)")
        if t.input_schema is None:
            raise bad(f"{where}.input_schema", "required for a custom tool")
        if t.input_schema.get("type") != "object":
            raise bad(f"{where}.input_schema.type", "must be \"object\"")
        out.append(tools.Tool(t.name, t.description, t.input_schema, t.strict is True))
    if len({t.name for t in out}) != len(out):
        raise bad("tools", "tool names must be unique")
    return out


def _choose(offered: list[tools.Tool], choice: ToolChoice | None) -> tuple[str, list[tools.Tool]]:
    """Anthropic's tool_choice, checked with its own field names, then normalized by tools.choose."""
    if choice is None:
        return tools.choose(offered, None)
    if choice.type == "tool":
        if choice.name is None:
            raise bad("tool_choice.name", "required when type is \"tool\"")
        if all(t.name != choice.name for t in offered):
            raise bad("tool_choice.name", f"no tool is named {choice.name!r}")
        return tools.choose(offered, {"type": "function", "function": {"name": choice.name}})
    if choice.type != "none" and not offered:
        raise bad("tool_choice.type", f"{choice.type!r} needs tools")
    return tools.choose(offered, {"auto": "auto", "any": "required", "none": "none"}[choice.type])


def engine_request(b: MessagesRequest, plan: Plan) -> tuple[chat_core.Sampling, RequestOptions]:
    """The chat core's sampling (its defaults, e.g. temperature 1.0, are Anthropic's too)."""
    if b.container is not None:
        raise bad("container", "code execution containers are not supported by this server")
    budget = b.thinking.budget_tokens if b.thinking is not None else None
    if budget is not None and budget >= b.max_tokens:
        raise bad("thinking.budget_tokens", f"must be less than max_tokens ({b.max_tokens}), got {budget}")
    if b.output_config is not None and b.output_config.format is not None and plan.mode == "required":
        raise bad("output_config.format", "cannot be combined with a required tool call (tool_choice any or tool)")
    sampling = chat_core.Sampling(max_tokens=b.max_tokens, stop=b.stop_sequences, temperature=b.temperature,
                                  top_p=b.top_p, top_k=b.top_k)
    return sampling, RequestOptions(rename=RENAME)


def answer(out: Output, a: reasoning.Answer, b: MessagesRequest) -> tuple[list[ContentBlock], str, str | None]:
    """The content blocks, stop_reason and stop_sequence of a finished output read as `a`
    (reasoning.read_long: an engine error is an ApiError 500, a stream's calls keep their ids)."""
    reason = out.finish_reason
    uses = [tool_use(c) for c in a.calls]
    blocks: list[ContentBlock] = []
    if a.reasoning is not None:  # cut off while thinking: the thinking block alone
        blocks.append(ThinkingBlock(a.reasoning if shows_thinking(b) else ""))
    if a.content or not (uses or a.reasoning is not None):
        blocks.append(TextBlock(a.content or ""))
    if uses:
        return [*blocks, *uses], "max_tokens" if reason == "length" else "tool_use", None
    if reason == "length":
        return blocks, "max_tokens", None
    if isinstance(out.matched_stop, str) and out.matched_stop in (b.stop_sequences or ()):
        return blocks, "stop_sequence", out.matched_stop
    return blocks, "end_turn", None


def tool_use(call: ToolCall) -> ToolUseBlock:
    """A call as a tool_use block, its id from the call's (a parsed call's arguments are an object;
    a call max_tokens cut short has what its arguments say so far, as Anthropic's does)."""
    args = loads(call.function.arguments)
    args = args if isinstance(args, dict) else cut_json(call.function.arguments)
    return ToolUseBlock("toolu_" + call.id.removeprefix("call_"), call.function.name, args if isinstance(args, dict) else {})
