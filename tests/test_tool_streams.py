"""Tool calls streamed as they complete, in chat, Responses and Messages alike (tool_choice auto):
the split of a streamed answer into text and calls (call_stream.CallStream), then each API's
stream on a fake engine that writes a known answer token by token, checked against the openai
and anthropic SDKs' own types and accumulators, and for *when* each call reaches the client."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import openai
import pydantic
import pytest
from chat_plans import chat_plan, messages_plan, responses_plan, responses_reply
from server_helpers import fake_state
from test_reasoning_apis import ScriptedEngine, Tok, _deltas, _frames, _msg, _opens_into, _out, _request

from radixserve.server import sse
from radixserve.server.anthropic import stream as anthropic_stream
from radixserve.server.anthropic.cache import Breakpoints
from radixserve.server.chat.call_stream import CallStream
from radixserve.server.chat.tools import Tool
from radixserve.server.errors import decode_body
from radixserve.server.openai import chat
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.responses import routes as responses
from radixserve.server.responses import stream as responses_stream

FN = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [Tool("f", "", FN), Tool("g", "", FN)]
# text, then two tagged calls: the first must reach the client before the second is written
TWO_CALLS = ["Let", " me", " check", ".\n", "<tool", "_call>", '{"name": "f", ', '"arguments": {"x": 1}}', "</tool_call>",
             "\n", "<tool_call>", '{"name": "g", "arguments": {"x": 2}}', "</tool", "_call>"]
FIRST_DONE, SECOND_DONE = 8, 13  # the pieces that complete each call


def _feed(stream: CallStream, pieces: list[str]) -> tuple[list[str], list[list[str]]]:
    """What each piece releases: the text, and the names of the calls."""
    out = [stream.feed(p) for p in pieces]
    return [t for t, _ in out], [[c.function.name for c in calls] for _, calls in out]


def test_text_streams_until_a_call_may_start_and_each_tagged_call_comes_when_it_closes():
    texts, calls = _feed(CallStream("hermes", TOOLS, False), TWO_CALLS)
    assert "".join(texts) == "Let me check." and texts[:3] == ["Let", " me", " check"]  # the newline is held
    assert calls[FIRST_DONE] == ["f"] and calls[SECOND_DONE] == ["g"]
    assert sum(calls, []) == ["f", "g"]


def test_a_marker_that_turns_out_to_be_text_is_released_and_parallel_false_keeps_one_call():
    texts, _ = _feed(CallStream("hermes", TOOLS, False), ["a <tool", "tip> b"])
    assert texts == ["a", " <tooltip> b"]
    _, calls = _feed(CallStream("hermes", TOOLS, True), TWO_CALLS)
    assert sum(calls, []) == ["f"]
    texts, calls = _feed(CallStream("hermes", TOOLS, False), ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>'])
    assert texts == [""] and calls == [[]]  # not an offered tool: content, sent when the answer is whole


def test_a_fenced_block_is_held_only_while_it_may_be_calls():
    s = CallStream("hermes", TOOLS, False)
    code = ["Try:\n", "```py", "thon\nprint(1)\n", "```", "\nDone"]
    texts, _ = _feed(s, code)
    assert "".join(texts) == "Try:\n```python\nprint(1)\n```\nDone" and texts[1] == ""
    texts, calls = _feed(CallStream("hermes", TOOLS, False), ["```json\n", '{"name": "f", "arguments": {"x": 1}}', "\n```"])
    assert texts == ["", "", ""] and calls == [[], [], []]  # a fenced call: the whole answer shows it


@pytest.mark.parametrize(("fmt", "pieces"), [
    ("llama3_json", ['{"name": "f", ', '"parameters": {"x": 1}}']),
    ("llama3_json", ["<|python", '_tag|>{"name": "f", "parameters": {"x": 1}}']),
    ("mistral", ["[TOOL_CALLS]", '[{"name": "f", "arguments": {"x": 1}}]']),
])
def test_answers_that_may_be_all_calls_are_held_whole(fmt, pieces):
    texts, calls = _feed(CallStream(fmt, TOOLS, False), pieces)
    assert texts == [""] * len(pieces) and sum(calls, []) == []
    texts, _ = _feed(CallStream(fmt, TOOLS, False), ["Hello", " there"])
    assert texts == ["Hello", " there"]


class _Recording(ScriptedEngine):
    """Streams TWO_CALLS one token per delta and notes how much had been written to it when
    each delta was taken."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[int] = []

    def _deltas(self):
        for d in _deltas(TWO_CALLS, _out(TWO_CALLS)):
            self.at.append(len(self.data))
            yield d


def test_chat_streams_text_then_each_call_as_a_tool_call_delta_as_it_completes(monkeypatch):
    sink = _Recording()
    monkeypatch.setattr(sse.SSEWriter, "open", _opens_into(sink))
    tools = [{"type": "function", "function": {"name": n, "parameters": FN}} for n in ("f", "g")]
    b = decode_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "stream": True}).encode(),
                    ChatCompletionRequest)
    state = fake_state(merged=sink.merged)
    asyncio.run(chat._chat_stream(None, state, b, SimpleNamespace(), chat_plan(b, None)[0]))
    datas = [line.removeprefix("data: ") for line in sink.data.decode().split("\n\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(x) for x in datas[:-1]]
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "f", {"x": 1}),
                                                                                          (1, "g", {"x": 2})]
    before_second = sink.data[: sink.at[FIRST_DONE + 1]].decode()
    assert '"name":"f"' in before_second and '"name":"g"' not in before_second  # sent as it completed
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state_ = ChatCompletionStreamState()
    for c in chunks:
        state_.handle_chunk(c)
    message = state_.get_final_completion().choices[0].message
    assert message.content == "Let me check." and [t.function.name for t in message.tool_calls] == ["f", "g"]


def test_responses_stream_each_function_call_item_as_it_completes(monkeypatch):
    sink = _Recording()
    monkeypatch.setattr(responses_stream.EventWriter, "open", _opens_into(sink))
    state = fake_state(run=sink.run, engine=SimpleNamespace(tokenizer=Tok(TWO_CALLS)))
    b = _request(tools=[{"type": "function", "name": n, "parameters": FN} for n in ("f", "g")])
    plan, _ = responses_plan(b, None)
    flight = SimpleNamespace(reqs=[None], tickets=[None], arrival=0.0)
    asyncio.run(responses._stream(*responses_reply(state, b, plan), flight))
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = [adapter.validate_python(data) for _, data in _frames(sink)]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "name", None)) for i in done] == [("message", None), ("function_call", "f"),
                                                                   ("function_call", "g")]
    final = events[-1].response
    assert [o.model_dump() for o in final.output] == [i.model_dump() for i in done]  # same items, same ids
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check."
    before_second = sink.data[: sink.at[FIRST_DONE + 1]].decode()  # sent as it completed
    assert before_second.count("event: response.function_call_arguments.done") == 1
    assert sink.data.decode().count("event: response.function_call_arguments.done") == 2
    from openai.lib.streaming.responses._responses import ResponseStreamState

    acc = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for e in events:
        acc.handle_event(e)


def test_messages_stream_each_tool_use_block_as_its_call_completes(monkeypatch):
    sink = _Recording()
    monkeypatch.setattr(anthropic_stream.EventWriter, "open", _opens_into(sink))
    state = fake_state(merged=sink.merged)
    b = _msg(tools=[{"name": n, "input_schema": FN} for n in ("f", "g")])
    flight = SimpleNamespace(reqs=[SimpleNamespace(prompt_len=7)])
    asyncio.run(anthropic_stream.stream_message(None, state, flight, messages_plan(b, None)[0], b, "msg_1",
                                                  Breakpoints([]).usage))
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    events = [adapter.validate_python(data) for name, data in _frames(sink) if name != "ping"]
    from anthropic.lib.streaming._messages import accumulate_event

    snap = None
    for e in events:
        snap = accumulate_event(event=e, current_snapshot=snap, json_bufs={})
    assert [(x.type, getattr(x, "name", None), getattr(x, "input", None)) for x in snap.content] == [
        ("text", None, None), ("tool_use", "f", {"x": 1}), ("tool_use", "g", {"x": 2})]
    assert snap.content[0].text == "Let me check." and snap.stop_reason == "tool_use"
    before_second = sink.data[: sink.at[FIRST_DONE + 1]].decode()
    assert '"name":"f"' in before_second and '"name":"g"' not in before_second
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]  # one block at a time, in order


def test_every_tool_call_and_reasoning_parser_the_cli_offers_is_in_its_one_table():
    """--tool-call-parser's choices (config.py, below server/ in the layers) name the formats of
    server.chat.tool_parsers.FORMATS, the one table every format is keyed in (mistral_v11 is chosen
    from a chat template, never by name)."""
    import dataclasses

    from radixserve.config import ServerConfig
    from radixserve.server.chat import tool_parsers

    field = next(f for f in dataclasses.fields(ServerConfig) if f.name == "tool_call_parser")
    offered = set(field.metadata["choices"]) - {"auto"}
    assert offered == set(tool_parsers.FORMATS) - {"mistral_v11"}
    from radixserve.server.chat import reasoning

    reasoning_field = next(f for f in dataclasses.fields(ServerConfig) if f.name == "reasoning_parser")
    assert set(reasoning_field.metadata["choices"]) == set(reasoning.PARSERS)  # the reasoning parsers' one table
    for template, fmt in (("<function=x><parameter=y>", "qwen3_coder"), ("<tool_call>", "hermes"),
                          ("[TOOL_CALLS][ARGS]", "mistral_v11"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")):
        assert tool_parsers.for_template(template) == fmt and fmt in tool_parsers.FORMATS
