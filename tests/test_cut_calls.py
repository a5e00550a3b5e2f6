"""A tool call cut short by max_tokens comes back as a call, its arguments as written so far, with
finish_reason "length" (chat), stop_reason "max_tokens" (Messages) and an incomplete response
whose function_call item is incomplete (Responses), whole and streamed, as the real APIs answer:
never as the answer's text, which an agent framework would take for its final answer. Read in
each format (server.cut_calls), then over HTTP on the tiny model, whose required call is the
constrained JSON and whose auto call a client regex writes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import openai
import pydantic
import pytest
from chat_plans import chat_plan, messages_plan, responses_plan, responses_reply
from server_helpers import USER, fake_state
from test_reasoning_apis import ScriptedEngine, Tok, _deltas, _frames, _msg, _opens_into, _out, _request

from radixserve.server import sse
from radixserve.server.anthropic import stream as anthropic_stream
from radixserve.server.anthropic.cache import Breakpoints
from radixserve.server.chat import reasoning
from radixserve.server.chat.text_scan import cut_json
from radixserve.server.chat.tools import Tool
from radixserve.server.errors import decode_body
from radixserve.server.openai import chat
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.responses import routes as responses
from radixserve.server.responses import stream as responses_stream

FN = {"type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}}}
TOOLS = [Tool("f", "", FN), Tool("g", "", FN)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    ("hermes", 'Sure.\n<tool_call>{"name": "f", "arguments": {"s": "Par', "Sure.", [("f", '{"s": "Par')]),
    ("hermes", '<tool_call>{"name": "g", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"x"',
     None, [("g", "{}"), ("f", '{"x"')]),
    ("hermes", '```json\n{\n  "name": "f",\n  "arguments": {"x": 3', None, [("f", '{"x": 3')]),
    ("qwen3_coder", "Hi <tool_call>\n<function=f>\n<parameter=x>\n3\n</parameter>\n<parameter=s>\nab", "Hi",
     [("f", '{"x": 3')]),
    ("mistral", '[TOOL_CALLS][{"name": "g", "arguments": {}}, {"name": "f", "arguments": {"x": 1', None,
     [("g", "{}"), ("f", '{"x": 1')]),
    ("mistral_v11", '[TOOL_CALLS]g[ARGS]{}[TOOL_CALLS]f[ARGS]{"x": ', None, [("g", "{}"), ("f", '{"x": ')]),
    ("llama3_json", '{"name": "g", "parameters": {}}; {"name": "f", "parameters": {"x', None, [("g", "{}"), ("f", '{"x')]),
])
def test_a_call_cut_short_is_a_call_with_its_arguments_as_written_in_each_format(fmt, text, content, calls):
    a = reasoning.answer(text, "length", None, "auto", TOOLS, fmt)
    assert (a.content, [(c.function.name, c.function.arguments) for c in a.calls], a.cut) == (content, calls, True)
    stopped = reasoning.answer(text, "stop", None, "auto", TOOLS, fmt)  # not cut by the limit: as before, text
    assert stopped.cut is False and len(stopped.calls) < len(calls)


def test_a_required_call_cut_short_is_a_call_and_one_cut_before_its_name_is_dropped():
    a = reasoning.answer('{\n  "name": "f",\n  "arguments": {"s": "a', "length", None, "required", TOOLS)
    assert (a.content, a.calls[0].function.name, a.calls[0].function.arguments, a.cut) == (None, "f", '{"s": "a', True)
    a = reasoning.answer('{\n  "name": "f",\n', "length", None, "required", TOOLS)
    assert (a.content, a.calls[0].function.arguments, a.cut) == (None, "", True)
    a = reasoning.answer('{"name": "f", "arguments": {"x": 1}}', "length", None, "required", TOOLS)
    assert (a.content, a.calls[0].function.arguments, a.cut) == (None, '{"x": 1}', False)  # whole: only EOS was cut
    for early in ('{"name": "', '{"na', "{"):  # no call (OpenAI never returns one without a name), and no JSON as text
        a = reasoning.answer(early, "length", None, "required", TOOLS)
        assert (a.content, a.calls) == (None, [])


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", 'Sure.<tool_call>\n{"name": "'), ("qwen3_coder", "Sure.<tool_call>\n<function=f"),
    ("mistral_v11", "Sure.[TOOL_CALLS]f"), ("llama3_json", '<|python_tag|>{"name": "f'),
])
def test_a_marked_call_cut_before_its_name_is_dropped_and_unmarked_json_stays_text(fmt, text):
    a = reasoning.answer(text, "length", None, "auto", TOOLS, fmt)
    assert a.calls == [] and a.content in ("Sure.", None)
    for text_ in ('```json\n{"name": "f', '{"name": "f'):  # no marker: it may be any JSON the answer shows
        fmt_ = "hermes" if text_.startswith("`") else "llama3_json"
        assert reasoning.answer(text_, "length", None, "auto", TOOLS, fmt_).content == text_
    not_offered = 'Hi <tool_call>{"name": "nope", "arguments": {"x": 1'  # as a whole call of it would: text
    assert reasoning.answer(not_offered, "length", None, "auto", TOOLS).content == not_offered


def test_a_cut_input_reads_as_far_as_it_goes():
    assert cut_json('{"s": "Par') == {"s": "Par"}
    assert cut_json('{"a": [1, {"b": tr') == {"a": [1, {}]}
    assert cut_json('{"a": 12') == {}  # a number may be cut: left out
    assert cut_json('{"a": 12, "k') == {"a": 12}
    assert cut_json('{"a": "x\\u00') == {"a": "x"}
    assert cut_json("") is None and cut_json("[" * 10_000) is not None


# -- each API's stream, on a fake engine that writes a call max_tokens cuts -------------------------
CUT = ["Let", " me", " check", ".\n", "<tool_call>", '{"name": "f", ', '"arguments": {"s": ', '"Par']


class _Engine(ScriptedEngine):
    """Streams CUT one token per delta, cut by the limit."""

    def _deltas(self):
        return _deltas(CUT, _out(CUT, "length"))


def test_a_chat_stream_ends_with_the_cut_call_and_finish_reason_length(monkeypatch):
    sink = _Engine()
    monkeypatch.setattr(sse.SSEWriter, "open", _opens_into(sink))
    tools = [{"type": "function", "function": {"name": n, "parameters": FN}} for n in ("f", "g")]
    b = decode_body(json.dumps({"messages": USER, "tools": tools, "stream": True}).encode(), ChatCompletionRequest)
    asyncio.run(chat._chat_stream(None, fake_state(merged=sink.merged), b, SimpleNamespace(),
                                  chat_plan(b, None)[0]))
    datas = [x.removeprefix("data: ") for x in sink.data.decode().split("\n\n") if x.startswith("data: ")][:-1]
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(x) for x in datas]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("f", '{"s": "Par')]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_responses_stream_ends_incomplete_with_the_cut_function_call(monkeypatch):
    sink = _Engine()
    monkeypatch.setattr(responses_stream.EventWriter, "open", _opens_into(sink))
    state = fake_state(run=sink.run, engine=SimpleNamespace(tokenizer=Tok(CUT)))
    b = _request(tools=[{"type": "function", "name": n, "parameters": FN} for n in ("f", "g")])
    asyncio.run(responses._stream(*responses_reply(state, b, responses_plan(b, None)[0]),
                                  SimpleNamespace(reqs=[None], tickets=[None], arrival=0.0)))
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = [adapter.validate_python(data) for _, data in _frames(sink)]
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    call = final.response.output[-1]
    assert (call.type, call.name, call.arguments, call.status) == ("function_call", "f", '{"s": "Par', "incomplete")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1] == call


def test_a_messages_stream_ends_with_the_cut_tool_use_and_max_tokens(monkeypatch):
    sink = _Engine()
    monkeypatch.setattr(anthropic_stream.EventWriter, "open", _opens_into(sink))
    b = _msg(tools=[{"name": n, "input_schema": FN} for n in ("f", "g")])
    asyncio.run(anthropic_stream.stream_message(None, fake_state(merged=sink.merged),
                                                SimpleNamespace(reqs=[SimpleNamespace(prompt_len=7)]),
                                                messages_plan(b, None)[0], b, "msg_1", Breakpoints([]).usage))
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    from anthropic.lib.streaming._messages import accumulate_event

    snap = None
    for _, data in _frames(sink):
        if data["type"] != "ping":
            snap = accumulate_event(event=adapter.validate_python(data), current_snapshot=snap, json_bufs={})
    assert [(x.type, getattr(x, "name", None), getattr(x, "input", None)) for x in snap.content] == [
        ("text", None, None), ("tool_use", "f", {"s": "Par"})]
    assert snap.stop_reason == "max_tokens"


# -- over HTTP, on the tiny model ----------------------------------------------------------------
LONG = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1000}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": LONG}}
AUTO_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "a{1000}"\}\}</tool_call>'  # a client's own


def _cut(name: str, arguments: str) -> None:
    """A call cut inside its arguments: the name whole, the arguments not (yet) JSON."""
    assert name == "get_weather" and arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("extra", [{"tool_choice": "required"}, {"regex": AUTO_REGEX}], ids=["required", "auto"])
def test_chat_returns_a_call_max_tokens_cut_as_a_call_whole_and_streamed(oai, extra):
    kw = {"model": "", "messages": USER, "max_tokens": 60, "temperature": 0, "tools": [CHAT_TOOL]}
    whole = oai.chat.completions.create(**kw, extra_body=extra)
    c = whole.choices[0]
    assert c.finish_reason == "length" and c.message.content is None and len(c.message.tool_calls) == 1
    _cut(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
    chunks = list(oai.chat.completions.create(**kw, extra_body=extra, stream=True))
    deltas = [t for ch in chunks for t in ch.choices[0].delta.tool_calls or []] if chunks else []
    assert [(t.function.name, t.function.arguments) for t in deltas] == [(c.message.tool_calls[0].function.name,
                                                                            c.message.tool_calls[0].function.arguments)]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_responses_return_a_call_max_tokens_cut_as_an_incomplete_function_call(oai):
    tool = {"type": "function", "name": "get_weather", "parameters": LONG}
    kw = {"model": "", "input": "Weather?", "max_output_tokens": 60, "temperature": 0, "tools": [tool],
          "tool_choice": "required", "store": False}
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in r.output] == [("function_call", "incomplete")]
    _cut(r.output[0].name, r.output[0].arguments)
    events = list(oai.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [(o.type, o.name, o.arguments) for o in events[-1].response.output] == [("function_call", r.output[0].name,
                                                                                       r.output[0].arguments)]


def test_messages_return_a_tool_use_max_tokens_cut_with_its_input_so_far(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = {"model": "", "max_tokens": 60, "messages": USER, "tools": [{"name": "get_weather", "input_schema": LONG}],
          "tool_choice": {"type": "any"}, "extra_body": {"temperature": 0}}
    m = client.messages.create(**kw)
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "get_weather" and list(m.content[0].input) == ["city"]  # its string, cut
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "max_tokens" and [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", m.content[0].input)]
