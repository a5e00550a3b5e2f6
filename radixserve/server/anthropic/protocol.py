"""Wire types of the Anthropic Messages API (/v1/messages), shaped as the `anthropic` SDK reads
and writes them. Blocks and events are tagged by their `type`; a stream event's tag is also its
SSE `event:` name. Request Structs forbid unknown fields (a typo is a 400 naming it), except
where a known kind must be decoded to be refused with a clear message (image and document
blocks, server tools)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.limits import MAX_MESSAGES, MAX_RID_CHARS, MAX_STOPS, MAX_TOOLS
from radixserve.server.protocol import _In, _Out  # the wire types' bases, declared once

CacheControl = dict[str, Any] | None  # {"type": "ephemeral", "ttl": "5m" | "1h"}: server/anthropic/cache.py


# -- request blocks --------------------------------------------------------------------------
class TextBlockParam(_In, tag="text", tag_field="type"):
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None  # accepted so a returned block can be sent back; ignored


class ImageBlockParam(msgspec.Struct, tag="image", tag_field="type"):
    """Decoded only to be refused by name (the served model reads text)."""

    source: Any = None


class DocumentBlockParam(msgspec.Struct, tag="document", tag_field="type"):
    """Decoded only to be refused by name."""

    source: Any = None


class ToolUseBlockParam(_In, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: Any = None


ToolResultContent = TextBlockParam | ImageBlockParam | DocumentBlockParam


class ToolResultBlockParam(_In, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool = False
    cache_control: CacheControl = None


class ThinkingBlockParam(_In, tag="thinking", tag_field="type"):
    """An earlier turn's thinking, sent back: accepted in an assistant message, left out of the prompt."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(_In, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (TextBlockParam | ImageBlockParam | DocumentBlockParam | ToolUseBlockParam | ToolResultBlockParam
         | ThinkingBlockParam | RedactedThinkingBlockParam)


class MessageParam(_In):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolParam(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A custom tool. Not strict about fields: a server tool (its own fields) is refused by its type."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str = ""
    type: str | None = None  # "custom" or absent
    cache_control: CacheControl = None
    strict: bool | None = None
    input_examples: list[Any] | None = None


class ToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_In):
    user_id: Annotated[str, Meta(max_length=MAX_RID_CHARS)] | None = None  # not used; bounded as every id we keep (256)


class OutputFormat(_In):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class ThinkingConfig(_In):
    """enabled (budget_tokens, a hint: nothing stops the reasoning at it) | adaptive (the model's
    own default) | disabled. Needs --reasoning-parser, except disabled."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: the thinking block's text is left empty


class OutputConfig(_In):
    format: OutputFormat | None = None  # the answer is JSON following the schema (a grammar enforces it)
    effort: str | None = None  # accepted: the served model has one effort


# -- requests --------------------------------------------------------------------------------
class CountTokensRequest(_In):
    """What makes a prompt: POST /v1/messages/count_tokens."""

    model: str
    messages: Annotated[list[MessageParam], Meta(max_length=MAX_MESSAGES)]
    system: str | list[TextBlockParam] | None = None
    tools: Annotated[list[ToolParam], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    speed: str | None = None  # accepted; there is one speed


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted; there is one tier
    inference_geo: str | None = None  # accepted; it runs here
    diagnostics: dict[str, Any] | None = None  # accepted; no cache-miss reasons are reported
    container: Any = None  # refused unless null: no code execution


# -- responses -------------------------------------------------------------------------------
class TextBlock(_Out, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(_Out, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Out, tag="thinking", tag_field="type"):
    """The output's `<think>` part (--reasoning-parser). No signature: nothing here is signed."""

    thinking: str
    signature: str = ""


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class CacheCreation(_Out):
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(_Out):
    """input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the prompt's tokens
    (server/anthropic/cache.py says how cache_control splits them)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache (any tier)
    cache_creation_input_tokens: int = 0  # tokens up to the last cache_control breakpoint not served from it
    cache_creation: CacheCreation | None = None  # that, by the breakpoints' TTLs


class Message(_Out, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(_Out):
    input_tokens: int


class ErrorObject(_Out):
    type: str
    message: str


class ErrorBody(_Out, tag="error", tag_field="type"):
    """An error: the JSON body of a 4xx/5xx, or an `event: error` in a stream that already began."""

    error: ErrorObject


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> ErrorBody:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return ErrorBody(ErrorObject(kind, message))


# -- stream events (the tag is the SSE event name) -------------------------------------------
class TextDelta(_Out, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(_Out, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(_Out, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(_Out, tag="signature_delta", tag_field="type"):
    """Sent just before a thinking block's content_block_stop."""

    signature: str


class MessageStart(_Out, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(_Out, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class Ping(_Out, tag="ping", tag_field="type"):
    pass


class ContentBlockDelta(_Out, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(_Out, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(_Out):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(_Out, tag="message_delta", tag_field="type"):
    delta: StopInfo
    usage: Usage  # cumulative totals: the SDK overwrites what message_start said


class MessageStop(_Out, tag="message_stop", tag_field="type"):
    pass


StreamEvent = MessageStart | ContentBlockStart | Ping | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | ErrorBody
