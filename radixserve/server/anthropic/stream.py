"""Anthropic's streaming: named SSE events, in the order its SDK accumulates them:

    message_start, ping, then per content block: content_block_start, content_block_delta...,
    content_block_stop, then message_delta (stop_reason, cumulative usage), message_stop

Text streams token by token (LiveBlocks): with --reasoning-parser, a thinking block
(thinking_delta..., then an empty signature_delta) while the output is inside `<think>`, then
the text block, then with tools (`tool_choice` auto) each tool_use block as its call completes
(its input as one input_json_delta; text from where a call may start is held until it is
known; a call only the whole answer shows comes at the end, as does a required call). An error
once the stream began is an `event: error`."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.server.anthropic import convert
from radixserve.server.anthropic.protocol import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDelta,
    StopInfo,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
    error_body,
)
from radixserve.server.chat import reasoning, tools
from radixserve.server.chat.core import Plan
from radixserve.server.errors import ApiError
from radixserve.server.protocol import ToolCall
from radixserve.server.sse import SSEWriter
from radixserve.server.state import Flight, ServerState

log = logging.getLogger(__name__)


class EventWriter(SSEWriter):
    """SSE as Anthropic writes it: an `event:` line names each event; no `data: [DONE]`."""

    async def emit(self, event: StreamEvent) -> None:
        name = type(event).__struct_config__.tag
        await self._write(b"event: " + str(name).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n")

    async def close(self) -> None:
        await self._bounded(self.response.write_eof())


async def stream_message(request: web.Request, state: ServerState, flight: Flight, plan: Plan, b: MessagesRequest,
                         mid: str, usage: Callable[[Output], Usage]) -> web.StreamResponse:
    sse = await EventWriter.open(request)
    start = Usage(flight.reqs[0].prompt_len, 0)  # the cache's share is known once it ran: message_delta says
    await sse.emit(MessageStart(Message(mid, "assistant", state.answered_by(b.model), [], None, None, start)))
    try:
        await _answer(sse, state, flight, plan, b, usage)
    except ApiError as e:  # the status line is sent: the error goes in the stream
        await sse.emit(error_body(e.status, e.message))
    except ConnectionError:
        raise
    except Exception as e:
        log.exception("error in a /v1/messages stream")
        await sse.emit(error_body(500, f"internal error while generating: {type(e).__name__}"))
    await sse.close()
    return sse.response


async def _answer(sse: EventWriter, state: ServerState, flight: Flight, plan: Plan, b: MessagesRequest,
                  usage: Callable[[Output], Usage]) -> None:
    await sse.emit(Ping())
    live, out = LiveBlocks(sse, plan, convert.shows_thinking(b)), None
    async for _, d in state.merged(flight):
        await live.feed(d.text, d.finished)
        out = d.output if d.finished else out
    if out is None:
        raise ApiError(500, "internal error while generating: the request ended without an output")
    blocks, reason, sequence = await reasoning.read_long([out], plan, lambda a: convert.answer(out, a, b),
                                                         live.streamed_calls())  # an engine error raises here
    await live.finish(blocks)
    await sse.emit(MessageDelta(StopInfo(reason, sequence), usage(out)))
    await sse.emit(MessageStop())


class LiveBlocks(reasoning.LiveParts):
    """The content blocks of one answer as its text comes: thinking, text and (with tools) each
    tool_use as its call completes (reasoning.LiveParts). `finish` closes what is open with the
    final blocks (built from the whole text, which the stream agrees with) and sends the rest
    whole, after the streamed ones."""

    def __init__(self, sse: EventWriter, plan: Plan, show: bool) -> None:
        calls = tools.call_stream(plan.mode, plan.offered, plan.tool_format, plan.one_call)
        super().__init__(plan.parser, plan.mode != "required", calls, plan.offered)
        self.sse, self.show = sse, show

    async def open_reasoning(self) -> None:
        await self.sse.emit(ContentBlockStart(self.parts.index("reasoning"), ThinkingBlock("")))

    async def reasoning_delta(self, text: str) -> None:
        if self.show:
            await self.sse.emit(ContentBlockDelta(self.parts.index("reasoning"), ThinkingDelta(text)))

    async def close_reasoning(self) -> None:
        await _stop(self.sse, self.parts.index("reasoning"), ThinkingBlock(""))

    async def open_content(self, index: int) -> None:
        await self.sse.emit(ContentBlockStart(index, TextBlock("")))

    async def content_delta(self, index: int, text: str) -> None:
        await self.sse.emit(ContentBlockDelta(index, TextDelta(text)))

    async def close_content(self, index: int) -> None:
        await _stop(self.sse, index, TextBlock(self.sent))

    async def tool_call(self, index: int, call: ToolCall) -> None:
        await _whole(self.sse, index, convert.tool_use(call))

    async def finish(self, blocks: list[ContentBlock]) -> None:
        keys = [_key(b) for b in blocks]
        if self.open_key in keys:
            block, at = blocks[keys.index(self.open_key)], self.parts.index(self.open_key)
            rest = self.rest(block.text) if isinstance(block, TextBlock) else ""
            if rest:
                await self.sse.emit(ContentBlockDelta(at, TextDelta(rest)))
            await _stop(self.sse, at, block)
        self.open_key = None
        at = len(self.parts)
        for key, block in zip(keys, blocks):
            if key not in self.parts:
                await _whole(self.sse, at, block)
                at += 1


def _key(block: ContentBlock) -> str:
    if isinstance(block, ToolUseBlock):
        return "call:call_" + block.id.removeprefix("toolu_")
    return "reasoning" if isinstance(block, ThinkingBlock) else "content"


async def _whole(sse: EventWriter, i: int, block: ContentBlock) -> None:
    """A block known only at the end."""
    if isinstance(block, ToolUseBlock):
        await sse.emit(ContentBlockStart(i, ToolUseBlock(block.id, block.name, {})))
        await sse.emit(ContentBlockDelta(i, InputJsonDelta(json.dumps(block.input))))
    elif isinstance(block, ThinkingBlock):
        await sse.emit(ContentBlockStart(i, ThinkingBlock("")))
        if block.thinking:
            await sse.emit(ContentBlockDelta(i, ThinkingDelta(block.thinking)))
    else:
        await sse.emit(ContentBlockStart(i, TextBlock("")))
        if block.text:
            await sse.emit(ContentBlockDelta(i, TextDelta(block.text)))
    await _stop(sse, i, block)


async def _stop(sse: EventWriter, i: int, block: ContentBlock) -> None:
    if isinstance(block, ThinkingBlock):  # a thinking block's signature comes just before its stop
        await sse.emit(ContentBlockDelta(i, SignatureDelta(block.signature)))
    await sse.emit(ContentBlockStop(i))
