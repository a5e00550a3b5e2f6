"""Anthropic's streaming: named SSE events, in the order its SDK accumulates them:

    message_start, then per content block: content_block_start, content_block_delta..., content_block_stop
    (a ping after the first start), message_delta (stop_reason, cumulative usage), message_stop

Free text streams token by token. With tools offered the answer is parsed whole, so its blocks
come at the end: a tool_use block's input as one input_json_delta. An error once the stream
began is an `event: error`."""

from __future__ import annotations

import json
import logging

import msgspec
from aiohttp import web

from radixserve.engine.outputs import Output
from radixserve.server import anthropic_convert as convert
from radixserve.server.anthropic_protocol import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    StopInfo,
    StreamEvent,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    Usage,
    error_body,
)
from radixserve.server.errors import ApiError
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


async def stream_message(request: web.Request, state: ServerState, flight: Flight, conv: convert.Conversation,
                         stops: list[str] | None, mid: str) -> web.StreamResponse:
    sse = await EventWriter.open(request)
    start = Usage(flight.reqs[0].prompt_len, 0)  # the cache's share is known once it ran: message_delta says
    await sse.emit(MessageStart(Message(mid, "assistant", state.model_name, [], None, None, start)))
    try:
        await _answer(sse, state, flight, conv, stops)
    except ApiError as e:  # the status line is sent: the error goes in the stream
        await sse.emit(error_body(e.status, e.message))
    except ConnectionError:
        raise
    except Exception as e:
        log.exception("error in a /v1/messages stream")
        await sse.emit(error_body(500, f"internal error while generating: {type(e).__name__}"))
    await sse.close()
    return sse.response


async def _answer(sse: EventWriter, state: ServerState, flight: Flight, conv: convert.Conversation,
                  stops: list[str] | None) -> None:
    if conv.mode == "none":
        out = await _stream_text(sse, state, flight)
    else:
        await sse.emit(Ping())
        out = (await state.collect(flight))[0]
    if out is None:
        raise ApiError(500, "internal error while generating: the request ended without an output")
    blocks, reason, sequence = convert.answer(out, conv, stops)  # an engine error raises here
    if conv.mode != "none":
        await _emit_blocks(sse, blocks)
    await sse.emit(MessageDelta(StopInfo(reason, sequence), convert.usage(out)))
    await sse.emit(MessageStop())


async def _stream_text(sse: EventWriter, state: ServerState, flight: Flight) -> Output | None:
    await sse.emit(ContentBlockStart(0, TextBlock("")))
    await sse.emit(Ping())
    out = None
    async for _, d in state.merged(flight):
        if d.text:
            await sse.emit(ContentBlockDelta(0, TextDelta(d.text)))
        if d.finished:
            out = d.output
    await sse.emit(ContentBlockStop(0))
    return out


async def _emit_blocks(sse: EventWriter, blocks: list[ContentBlock]) -> None:
    for i, block in enumerate(blocks):
        if isinstance(block, ToolUseBlock):
            await sse.emit(ContentBlockStart(i, ToolUseBlock(block.id, block.name, {})))
            await sse.emit(ContentBlockDelta(i, InputJsonDelta(json.dumps(block.input))))
        else:
            await sse.emit(ContentBlockStart(i, TextBlock("")))
            if block.text:
                await sse.emit(ContentBlockDelta(i, TextDelta(block.text)))
        await sse.emit(ContentBlockStop(i))
