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

Free text streams as it comes (LiveItems): the reasoning item while the output is inside
`<think>`, then the message. With tools the output is parsed whole, so its items come at the end.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.server import reasoning
from radixserve.server.responses_protocol import (
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
    """The output items of one response as its text comes (`live`: free text, no tools to parse).
    Items open lazily, in output order: the reasoning item once the splitter sees reasoning, the
    message at its first content. `finish` closes what is open with the final items (built from
    the whole text, which the stream's split always agrees with) and sends the rest whole.

    NOTE: `ids` are the final items' ids (reasoning, message), so what streamed and the
    response.completed output name the same items."""

    def __init__(self, w: EventWriter, parser: str | None, ids: tuple[str, str], live: bool) -> None:
        super().__init__(parser, live)
        self.w, self.ids = w, ids
        self.thought: list[str] = []

    async def open_reasoning(self) -> None:
        await self.w.open_reasoning(0, self.ids[0])

    async def reasoning_delta(self, text: str) -> None:
        self.thought.append(text)
        await self.w.reasoning_delta(0, self.ids[0], text)

    async def close_reasoning(self) -> None:
        await self.w.close_reasoning(0, ReasoningOutput(self.ids[0], [ReasoningText("".join(self.thought))]))

    async def open_content(self, index: int) -> None:
        await self.w.open_message(index, self.ids[1])

    async def content_delta(self, index: int, text: str) -> None:
        await self.w.text_delta(index, self.ids[1], text)

    async def finish(self, items: list[OutputItem]) -> None:
        for index, item in enumerate(items):
            if index < self.closed:
                continue
            if index >= self.opened:
                await self.w.whole(index, item)
            elif isinstance(item, ReasoningOutput):
                await self.w.close_reasoning(index, item)
            elif isinstance(item, OutputMessage):
                await self.w.close_message(index, item)
