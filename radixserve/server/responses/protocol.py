"""Wire types of the OpenAI Responses API (/v1/responses): the request, the response object and
its output items, the streamed events, and what a stored response keeps for a continuation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.limits import MAX_MESSAGES, MAX_METADATA_KEYS, MAX_RID_CHARS, MAX_TOOLS
from radixserve.server.protocol import PromptCacheRetention, Temperature, TopP, _In, _Out

ShortText = Annotated[str, Meta(max_length=MAX_RID_CHARS)]
# OpenAI's own caps: 16 pairs, keys of up to 64 characters, values of up to 512
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=MAX_METADATA_KEYS)]


# -- the request -----------------------------------------------------------------------------
class InputPart(_In):
    """A content part: input_text or output_text (text only)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # accepted so an output item can be sent back; ignored
    logprobs: list[Any] | None = None
    parsed: Any = None  # what the openai client's parse() added


class InputItem(_In):
    """One input item: a message (`type` may be left out), a function_call, a
    function_call_output, or a reasoning item sent back (dropped from the prompt). Which fields
    each kind needs is checked when it is converted."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: ShortText | None = None
    status: str | None = None
    phase: str | None = None
    call_id: ShortText | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    namespace: str | None = None
    parsed_arguments: Any = None  # what the openai client's parse() added
    summary: list[Any] | None = None  # a reasoning item's
    encrypted_content: str | None = None


class TextFormat(_In):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(_In):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CreateResponseRequest(_In):
    model: str = ""
    input: str | Annotated[list[InputItem], Meta(max_length=MAX_MESSAGES)] = ""
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: Temperature = None
    top_p: TopP = None
    stream: bool = False
    store: bool = True
    previous_response_id: ShortText | None = None
    metadata: Metadata | None = None
    user: ShortText | None = None
    parallel_tool_calls: bool | None = None
    # accepted and ignored: harmless hints OpenAI clients send
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None  # effort "none" turns thinking off; the rest is ignored
    service_tier: str | None = None
    prompt_cache_key: ShortText | None = None  # a routing hint, passed on as chat passes it
    prompt_cache_retention: PromptCacheRetention = None
    safety_identifier: ShortText | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None  # only 0: no logprobs are returned
    background: bool | None = None  # only false: every response runs in the foreground


# -- the response object ---------------------------------------------------------------------
class OutputText(_Out, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(_Out, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(_Out, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"  # in_progress | completed | incomplete
    role: Literal["assistant"] = "assistant"


class FunctionCallOutput(_Out, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str = "completed"


class ReasoningOutput(_Out, tag_field="type", tag="reasoning"):
    """The `<think>` part of the output (--reasoning-parser), as the model wrote it: no summary."""

    id: str
    content: list[ReasoningText]
    status: str = "completed"  # in_progress | completed | incomplete
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = ReasoningOutput | OutputMessage | FunctionCallOutput


class InputTokensDetails(_Out):
    cached_tokens: int
    cache_write_tokens: int = 0  # required by the openai SDK's type; the prefix cache writes without charge


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(_Out):
    code: str
    message: str


class IncompleteDetails(_Out):
    reason: str | None


class ResponseObject(_Out):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed
    output: list[OutputItem]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    store: bool
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    truncation: str = "disabled"
    background: bool = False
    object: Literal["response"] = "response"


class DeletedResponse(_Out):
    id: str
    deleted: bool = True
    object: Literal["response"] = "response"


class InputItemList(_Out):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# -- streamed events (each also goes out as the SSE `event:` name) ---------------------------
class ResponseEvent(_Out):
    """response.created | in_progress | completed | incomplete | failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class ItemEvent(_Out):
    """response.output_item.added | done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(_Out):
    """response.content_part.added | done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Out):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(_Out):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningDeltaEvent(_Out):
    """response.reasoning_text.delta."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Out):
    """response.reasoning_text.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Out):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Out):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Out):
    type: str
    sequence_number: int
    message: str
    code: str | None = None
    param: str | None = None


# -- what a stored response keeps --------------------------------------------------------------
class Context(msgspec.Struct):
    """The conversation so far, for a continuation (previous_response_id).

    NOTE: `text` is the rendered prompt followed by the output as the model wrote it, and `ids`
    the very tokens the engine ran (prompt, then output): a continuation whose rendered text
    starts with `text` reuses `ids` as its first tokens, so the prefix cache holds them all.
    The instructions are not kept (OpenAI does not carry them over)."""

    messages: list[dict[str, Any]]  # chat messages without the instructions; the output as one assistant message
    text: str
    ids: list[int]
