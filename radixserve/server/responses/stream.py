"""The Responses API's streamed events: `event: <type>` and `data: <json>` per event, each
numbered by `sequence_number`, no `[DONE]` (as OpenAI). The order, per output item:

    response.created, response.in_progress
    reasoning:      output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                    content_part.done, output_item.done
    message:        output_item.added, content_part.added, output_text.delta..., output_text.done,
                    content_part.done, output_item.done
    function call:  output_item.added, function_call_arguments.delta, function_call_arguments.done,
                    output_item.done
    response.completed | response.incomplete   (or: error, response.failed)

Text streams as it comes (LiveItems): the reasoning item while the output is inside `<think>`,
then the message, then with tools (`tool_choice` auto) each function call as it completes in the
model's format (text from where a call may start is held until it is known; a call only the
whole answer shows, e.g. a fenced one, comes at the end). A required call comes at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from radixserve.server.chat import reasoning
from radixserve.server.chat.call_stream import CallStream
from radixserve.server.chat.tools import Tool
from radixserve.server.protocol import ToolCall
from radixserve.server.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
    FunctionCallOutput,
    ItemEvent,
    OutputItem,
    OutputMessage,
    OutputText,
    PartEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)
from radixserve.server.sse import SSEWriter


class EventWriter(SSEWriter):
    """An SSEWriter for typed events: numbers them and names each in its `event:` line."""

    seq = 0

    async def emit(self, cls: type, kind: str, *fields: Any) -> None:
        event = cls(kind, self.seq, *fields)
        self.seq += 1
        await self._write(b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n")

    async def close(self) -> None:
        await self._bounded(self.response.write_eof())

    # -- the response ------------------------------------------------------------------------
    async def start(self, resp: ResponseObject) -> None:
        await self.emit(ResponseEvent, "response.created", resp)
        await self.emit(ResponseEvent, "response.in_progress", resp)

    async def finish(self, resp: ResponseObject) -> None:
        kind = "response.incomplete" if resp.status == "incomplete" else "response.completed"
        await self.emit(ResponseEvent, kind, resp)
        await self.close()

    async def fail(self, resp: ResponseObject, code: str, message: str) -> None:
        await self.emit(ErrorEvent, "error", message, code)
        failed = msgspec.structs.replace(resp, status="failed", error=ResponseError(code, message))
        await self.emit(ResponseEvent, "response.failed", failed)
        await self.close()

    # -- output items ------------------------------------------------------------------------
    async def open_message(self, index: int, item_id: str) -> None:
        await self.emit(ItemEvent, "response.output_item.added", index, OutputMessage(item_id, [], "in_progress"))
        await self.emit(PartEvent, "response.content_part.added", item_id, index, 0, OutputText(""))

    async def text_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit(TextDeltaEvent, "response.output_text.delta", item_id, index, 0, delta)

    async def close_message(self, index: int, item: OutputMessage) -> None:
        part = item.content[0] if item.content else OutputText("")
        await self.emit(TextDoneEvent, "response.output_text.done", item.id, index, 0, part.text)
        await self.emit(PartEvent, "response.content_part.done", item.id, index, 0, part)
        await self.emit(ItemEvent, "response.output_item.done", index, item)

    async def open_reasoning(self, index: int, item_id: str) -> None:
        await self.emit(ItemEvent, "response.output_item.added", index, ReasoningOutput(item_id, [], "in_progress"))
        await self.emit(PartEvent, "response.content_part.added", item_id, index, 0, ReasoningText(""))

    async def reasoning_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit(ReasoningDeltaEvent, "response.reasoning_text.delta", item_id, index, 0, delta)

    async def close_reasoning(self, index: int, item: ReasoningOutput) -> None:
        part = item.content[0] if item.content else ReasoningText("")
        await self.emit(ReasoningDoneEvent, "response.reasoning_text.done", item.id, index, 0, part.text)
        await self.emit(PartEvent, "response.content_part.done", item.id, index, 0, part)
        await self.emit(ItemEvent, "response.output_item.done", index, item)

    async def function_call(self, index: int, item: FunctionCallOutput) -> None:
        opened = msgspec.structs.replace(item, arguments="", status="in_progress")
        await self.emit(ItemEvent, "response.output_item.added", index, opened)
        await self.emit(ArgumentsDeltaEvent, "response.function_call_arguments.delta", item.id, index, item.arguments)
        await self.emit(ArgumentsDoneEvent, "response.function_call_arguments.done", item.id, index, item.arguments)
        await self.emit(ItemEvent, "response.output_item.done", index, item)

    async def whole(self, index: int, item: OutputItem) -> None:
        """An item known only at the end (with tools, the output is parsed once complete)."""
        if isinstance(item, FunctionCallOutput):
            await self.function_call(index, item)
            return
        text = item.content[0].text if item.content else ""
        if isinstance(item, ReasoningOutput):
            await self.open_reasoning(index, item.id)
            if text:
                await self.reasoning_delta(index, item.id, text)
            await self.close_reasoning(index, item)
        else:
            await self.open_message(index, item.id)
            if text:
                await self.text_delta(index, item.id, text)
            await self.close_message(index, item)


class LiveItems(reasoning.LiveParts):
    """The output items of one response as its text comes: reasoning, message and (with tools)
    each function call as it completes (reasoning.LiveParts). `finish` closes what is open with
    the final items (built from the whole text, which the stream agrees with), sends the rest
    whole, and returns the items in the order they streamed (the response's output).

    NOTE: `ids` are the final items' ids (reasoning, message), so what streamed and the
    response.completed output name the same items; a function call's item id comes from its
    call id (`call_item_id`)."""

    def __init__(self, w: EventWriter, parser: str | None, ids: tuple[str, str], live: bool,
                 calls: CallStream | None = None, offered: Sequence[Tool] = ()) -> None:
        super().__init__(parser, live, calls, offered)
        self.w, self.ids = w, ids
        self.thought: list[str] = []

    async def open_reasoning(self) -> None:
        await self.w.open_reasoning(self.parts.index("reasoning"), self.ids[0])

    async def reasoning_delta(self, text: str) -> None:
        self.thought.append(text)
        await self.w.reasoning_delta(self.parts.index("reasoning"), self.ids[0], text)

    async def close_reasoning(self) -> None:
        item = ReasoningOutput(self.ids[0], [ReasoningText("".join(self.thought))])
        await self.w.close_reasoning(self.parts.index("reasoning"), item)

    async def open_content(self, index: int) -> None:
        await self.w.open_message(index, self.ids[1])

    async def content_delta(self, index: int, text: str) -> None:
        await self.w.text_delta(index, self.ids[1], text)

    async def close_content(self, index: int) -> None:
        await self.w.close_message(index, OutputMessage(self.ids[1], [OutputText(self.sent)]))

    async def tool_call(self, index: int, call: ToolCall) -> None:
        await self.w.function_call(index, function_item(call))

    async def finish(self, items: list[OutputItem]) -> list[OutputItem]:
        by_key = {_key(item): item for item in items}
        for key in self.parts:  # a part the final answer does not have (not expected): closed as streamed
            if key == self.open_key and key in by_key:
                item = by_key[key]
                if isinstance(item, ReasoningOutput):
                    await self.w.close_reasoning(self.parts.index(key), item)
                elif isinstance(item, OutputMessage):
                    rest = self.rest(item.content[0].text if item.content else "")
                    if rest:
                        await self.w.text_delta(self.parts.index(key), item.id, rest)
                    await self.w.close_message(self.parts.index(key), item)
        self.open_key = None
        streamed = [by_key[k] for k in self.parts if k in by_key]
        for item in items:
            if _key(item) not in self.parts:
                await self.w.whole(len(streamed), item)
                streamed.append(item)
        return streamed


def function_item(call: ToolCall, status: str = "completed") -> FunctionCallOutput:
    return FunctionCallOutput(call_item_id(call), call.id, call.function.name, call.function.arguments, status)


def call_item_id(call: ToolCall) -> str:
    return "fc_" + call.id.removeprefix("call_")


def _key(item: OutputItem) -> str:
    if isinstance(item, FunctionCallOutput):
        return "call:" + item.call_id
    return "reasoning" if isinstance(item, ReasoningOutput) else "content"
