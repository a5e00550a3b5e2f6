"""--reasoning-parser in /v1/responses (a leading reasoning item) and /v1/messages (a leading
thinking block), whole and streamed, checked against the openai and anthropic SDKs' own types.
The tiny random model never writes <think>: the shapes are checked on fake outputs, and a served
model checks that output without tags has no reasoning item or thinking block."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import anthropic
import msgspec
import openai
import pydantic
import pytest
from chat_plans import messages_plan, responses_plan, responses_reply
from helpers import Sink
from server_helpers import USER, ServerProcess, fake_state

from radixserve.engine.outputs import Delta, Output
from radixserve.server.anthropic import cache as anthropic_cache
from radixserve.server.anthropic import convert
from radixserve.server.anthropic import stream as anthropic_stream
from radixserve.server.anthropic.cache import Breakpoints
from radixserve.server.anthropic.protocol import Message, MessagesRequest
from radixserve.server.chat import reasoning
from radixserve.server.errors import ApiError, decode_body
from radixserve.server.responses import routes as responses
from radixserve.server.responses import stream as responses_stream
from radixserve.server.responses.protocol import CreateResponseRequest
from radixserve.server.responses.translate import listed_items, new_response, to_messages

ONE_TAG = ["<think>", "\n", "plan", " it", "</think>", "\n\n", "The", " answer"]  # </think> is one token
CUT_TAG = ["<think>", "\n", "plan", " it", "</", "think", ">", "\n\n", "The", " answer"]  # ... or three
CALL = ["<think>", 'call f with {"x": 2}', "</think>", '{"name": "f", ', '"arguments": {"x": 1}}']
FN = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


class Tok:
    """A tokenizer whose token i is pieces[i]."""

    unk_token_id = None

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.pieces.index(token) if token in self.pieces else None


def _out(pieces: list[str], reason: str = "stop") -> Output:
    return Output("r", "".join(pieces), list(range(len(pieces))), reason, 7, len(pieces), 0)


def _opens_into(sink: Sink) -> classmethod:
    """An SSE writer's `open` that writes into `sink` instead of an HTTP response."""

    async def open_(cls, request):
        return cls(sink, 5.0)

    return classmethod(open_)


def _frames(sink: Sink) -> list[tuple[str, dict]]:
    blocks = [b.split("\n") for b in sink.data.decode().strip().split("\n\n")]
    assert all(b[0].startswith("event: ") for b in blocks)
    return [(b[0][7:], json.loads(b[1].removeprefix("data: "))) for b in blocks]


def _deltas(pieces: list[str], out: Output) -> list[Delta]:
    """One delta per token, the last carrying the output (as the engine streams)."""
    n = len(pieces)
    return [Delta("r", p, [i], finished=i == n - 1, output=out if i == n - 1 else None) for i, p in enumerate(pieces)]


class ScriptedEngine(Sink):
    """A sink that stands in for the engine too: it streams `_deltas()` (`merged` as
    ServerState.merged, `run` as ServerState.run)."""

    def _deltas(self):
        raise NotImplementedError

    async def merged(self, flight):
        for d in self._deltas():
            yield 0, d

    async def run(self, req, ticket, arrival):
        for d in self._deltas():
            yield d


# -- /v1/responses -------------------------------------------------------------------------------
def _request(**body) -> CreateResponseRequest:
    return decode_body(json.dumps({"model": "", "input": "hi", "store": False, **body}).encode(), CreateResponseRequest)


def _respond(pieces: list[str], parser: str | None, reason: str = "stop", **body) -> openai.types.responses.Response:
    b = _request(**body)
    plan, _ = responses_plan(b, parser)
    resp = new_response("m", b)
    out = _out(pieces, reason)
    responses.finish(resp, out, asyncio.run(reasoning.read_answer(out, plan, tok=Tok(pieces))), ("rs_1", "msg_1"))
    return openai.types.responses.Response.model_validate_json(msgspec.json.encode(resp))


@pytest.mark.parametrize(("pieces", "counted"), [(ONE_TAG, 5), (CUT_TAG, 7)])
def test_a_response_starts_with_its_reasoning_item_and_counts_its_tokens(pieces, counted):
    r = _respond(pieces, "qwen3")
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    thought = r.output[0]
    assert (thought.id, thought.summary, thought.status) == ("rs_1", [], "completed")
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "plan it")]
    assert r.output_text == "The answer" and r.output[1].id == "msg_1"
    assert r.usage.output_tokens_details.reasoning_tokens == counted  # the tokens up to </think>, as written
    plain = _respond(pieces, None)  # no parser: the tags are the message's text
    assert [o.type for o in plain.output] == ["message"] and plain.output_text == "".join(pieces)
    assert plain.usage.output_tokens_details.reasoning_tokens == 0


def test_a_required_tool_call_is_read_after_the_reasoning_and_constrained_only_there():
    tool = {"type": "function", "name": "f", "parameters": FN}
    _, params = responses_plan(_request(tools=[tool], tool_choice="required"), "qwen3")
    assert params.grammar_after == "</think>" and params.json_schema
    r = _respond(CALL, "qwen3", tools=[tool], tool_choice="required")
    assert [o.type for o in r.output] == ["reasoning", "function_call"]  # no message
    assert r.output[0].content[0].text == 'call f with {"x": 2}' and json.loads(r.output[1].arguments) == {"x": 1}
    assert responses_plan(_request(text={"format": {"type": "json_object"}}), None)[1].grammar_after is None


def test_a_response_cut_off_while_reasoning_is_its_reasoning_item_alone():
    r = _respond(["<think>", "still", " going"], "qwen3", reason="length")
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].status == "incomplete"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 3


def test_reasoning_effort_none_turns_thinking_off_in_the_template_and_the_split_off():
    plan, params = responses_plan(_request(reasoning={"effort": "none"}, text={"format": {"type": "json_object"}}), "qwen3")
    assert plan.parser is None and plan.template_kwargs == {"enable_thinking": False}
    assert params.grammar_after is None  # the template closed the reasoning: constrained from the first token
    assert responses_plan(_request(reasoning={"effort": "low"}), "qwen3")[0].parser == "qwen3"


def test_a_reasoning_item_sent_back_is_listed_but_left_out_of_the_prompt():
    r = _respond(ONE_TAG, "qwen3")
    items = [{"role": "user", "content": "hi"}, *(o.model_dump(exclude_none=True) for o in r.output),
             {"role": "user", "content": "and?"}]
    b = _request(input=items)
    assert to_messages(b.input) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer"},
                                    {"role": "user", "content": "and?"}]
    listed = listed_items(b.input)
    assert listed[1] == {"type": "reasoning", "id": "rs_1", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "plan it"}]}
    with pytest.raises(ApiError, match=r"^input: must hold a message"):
        to_messages(_request(input=[items[1]]).input)


def _stream_response(pieces: list[str], parser: str | None, monkeypatch, **body) -> tuple[list, dict]:
    """responses._stream on a fake engine: the SSE events, and the whole answer's response."""
    out, sink = _out(pieces), Sink()
    monkeypatch.setattr(responses_stream.EventWriter, "open", _opens_into(sink))

    async def run(req, ticket, arrival):
        for d in _deltas(pieces, out):
            yield d

    state = fake_state(run=run, engine=SimpleNamespace(tokenizer=Tok(pieces)))
    b = _request(**body)
    plan, _ = responses_plan(b, parser)
    flight = SimpleNamespace(reqs=[None], tickets=[None], arrival=0.0)
    asyncio.run(responses._stream(*responses_reply(state, b, plan), flight))
    frames = _frames(sink)
    assert [name for name, _ in frames] == [data["type"] for _, data in frames]
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    return [adapter.validate_python(data) for _, data in frames], frames[-1][1]["response"]


REASONING_EVENTS = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.mark.parametrize("pieces", [ONE_TAG, CUT_TAG])
def test_a_streamed_response_sends_the_reasoning_item_first_as_openai_types_it(pieces, monkeypatch):
    events, final = _stream_response(pieces, "qwen3", monkeypatch)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = REASONING_EVENTS[:3] + REASONING_EVENTS[2:]  # "plan", " it"
    message = [k.replace("reasoning_text", "output_text") for k in reasoning]  # "The", " answer"
    assert [e.type for e in events] == ["response.created", "response.in_progress", *reasoning, *message,
                                        "response.completed"]
    assert [e.output_index for e in events[2:-1]] == [0] * 7 + [1] * 7
    assert [e.delta for e in events if e.type.endswith(".delta")] == ["plan", " it", "The", " answer"]  # no tag text
    done = [e.item.model_dump() for e in events if e.type == "response.output_item.done"]
    assert done == [o.model_dump() for o in openai.types.responses.Response.model_validate(final).output]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    from openai.lib.streaming.responses._responses import ResponseStreamState

    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for e in events:  # the SDK's own accumulator takes the stream without complaint
        state.handle_event(e)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == pieces.index(">" if ">" in pieces else "</think>") + 1


def test_a_streamed_response_with_tools_sends_its_items_whole_at_the_end(monkeypatch):
    tool = {"type": "function", "name": "f", "parameters": FN}
    events, final = _stream_response(CALL, "qwen3", monkeypatch, tools=[tool], tool_choice="required")
    kinds = [e.type for e in events]
    assert kinds[2:8] == REASONING_EVENTS and kinds[8] == "response.output_item.added"
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "function_call"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]


# -- /v1/messages --------------------------------------------------------------------------------
def _msg(**body) -> MessagesRequest:
    return decode_body(json.dumps({"model": "", "max_tokens": 2048, "messages": USER, **body}).encode(), MessagesRequest)


ENABLED = {"thinking": {"type": "enabled", "budget_tokens": 1024}}


def test_thinking_needs_a_parser_and_its_budget_is_checked_as_anthropic_checks_it():
    with pytest.raises(ApiError, match="start the server with --reasoning-parser") as e:
        convert.conversation(_msg(**ENABLED), None)
    assert e.value.param == "thinking"
    for thinking, problem in [({"type": "enabled"}, "required when"),
                              ({"type": "enabled", "budget_tokens": 1023}, "must be at least 1024, got 1023"),
                              ({"type": "adaptive", "budget_tokens": 2000}, "only allowed when")]:
        with pytest.raises(ApiError, match=f"^thinking.budget_tokens: {problem}"):
            convert.conversation(_msg(thinking=thinking), "qwen3")
    b = _msg(max_tokens=1024, **ENABLED)
    with pytest.raises(ApiError, match=r"^thinking.budget_tokens: must be less than max_tokens \(1024\)"):
        convert.engine_request(b, convert.conversation(b, "qwen3"))
    off, _ = messages_plan(_msg(thinking={"type": "disabled"}), "qwen3")
    assert (off.parser, off.template_kwargs) == (None, {"enable_thinking": False})  # the template closes the reasoning
    assert messages_plan(_msg(), "qwen3")[0].parser == "qwen3"  # omitted: the model's default, split
    assert convert.conversation(_msg(**ENABLED), "deepseek_r1").template_kwargs == {"enable_thinking": True}


def _message(pieces: list[str], parser: str | None, reason: str = "stop", **body) -> anthropic.types.Message:
    b = _msg(**body)
    conv, _ = messages_plan(b, parser)
    out = _out(pieces, reason)
    blocks, stop, seq = convert.answer(out, reasoning.read(out, conv), b)
    use = anthropic_cache.Breakpoints([]).usage(_out(pieces))
    wire = msgspec.json.encode(Message("msg_1", "assistant", "m", blocks, stop, seq, use))
    return anthropic.types.Message.model_validate_json(wire)


def test_a_message_starts_with_a_thinking_block_then_the_content_blocks():
    m = _message(ONE_TAG, "qwen3", **ENABLED)
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "signature", None)) for b in m.content] == [
        ("thinking", "plan it", ""), ("text", None, None)]
    assert m.content[1].text == "The answer" and m.stop_reason == "end_turn"
    tool = {"name": "f", "input_schema": FN}
    b = _msg(tools=[tool], tool_choice={"type": "any"}, **ENABLED)
    _, params = messages_plan(b, "qwen3")
    assert params.grammar_after == "</think>" and params.json_schema
    m = _message(CALL, "qwen3", tools=[tool], tool_choice={"type": "any"}, **ENABLED)
    assert [x.type for x in m.content] == ["thinking", "tool_use"] and m.content[1].input == {"x": 1}
    assert m.stop_reason == "tool_use"
    cut = _message(["<think>", "still"], "qwen3", reason="length")
    assert [x.type for x in cut.content] == ["thinking"] and cut.stop_reason == "max_tokens"
    hidden = _message(ONE_TAG, "qwen3", thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert hidden.content[0].thinking == "" and hidden.content[1].text == "The answer"
    plain = _message(ONE_TAG, "qwen3", thinking={"type": "disabled"})
    assert [x.type for x in plain.content] == ["text"] and plain.content[0].text == "".join(ONE_TAG)


def test_thinking_blocks_sent_back_are_accepted_and_left_out_of_the_prompt():
    said = [{"type": "thinking", "thinking": "plan it", "signature": ""}, {"type": "redacted_thinking", "data": "x"},
            {"type": "text", "text": "The answer"}]
    b = _msg(messages=[*USER, {"role": "assistant", "content": said}, {"role": "user", "content": "and?"}], **ENABLED)
    assert convert.conversation(b, "qwen3").messages[1] == {"role": "assistant", "content": "The answer"}
    b = _msg(messages=[{"role": "user", "content": said[:1]}])
    with pytest.raises(ApiError, match=r"^messages\[0\]\.content\[0\]\.type: 'thinking': not allowed in a user message"):
        convert.conversation(b, "qwen3")


def _stream_message(pieces: list[str], parser: str | None, monkeypatch, **body) -> list:
    out, sink = _out(pieces), Sink()
    monkeypatch.setattr(anthropic_stream.EventWriter, "open", _opens_into(sink))

    async def merged(flight):
        for d in _deltas(pieces, out):
            yield 0, d

    state = fake_state(merged=merged)
    b = _msg(**body)
    flight = SimpleNamespace(reqs=[SimpleNamespace(prompt_len=7)])
    asyncio.run(anthropic_stream.stream_message(None, state, flight, messages_plan(b, parser)[0], b, "msg_1",
                                                  Breakpoints([]).usage))
    frames = _frames(sink)
    assert [name for name, _ in frames] == [data["type"] for _, data in frames]
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)  # the SDK drops pings
    return [adapter.validate_python(data) for name, data in frames if name != "ping"]


def _accumulated(events: list) -> anthropic.types.Message:
    from anthropic.lib.streaming._messages import accumulate_event

    snap = None
    for e in events:
        snap = accumulate_event(event=e, current_snapshot=snap, json_bufs={})
    return snap


@pytest.mark.parametrize("pieces", [ONE_TAG, CUT_TAG])
def test_a_streamed_message_sends_its_thinking_block_first_as_anthropic_types_it(pieces, monkeypatch):
    events = _stream_message(pieces, "qwen3", monkeypatch, **ENABLED)
    shape = [(e.type, getattr(e, "index", None), getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert shape == [("message_start", None, None), ("content_block_start", 0, None),
                     *[("content_block_delta", 0, "thinking_delta")] * 2, ("content_block_delta", 0, "signature_delta"),
                     ("content_block_stop", 0, None), ("content_block_start", 1, None),
                     *[("content_block_delta", 1, "text_delta")] * 2, ("content_block_stop", 1, None),
                     ("message_delta", None, None), ("message_stop", None, None)]
    assert events[1].content_block.type == "thinking" and events[6].content_block.type == "text"
    m = _accumulated(events)
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [("thinking", "plan it"), ("text", None)]
    assert m.content[0].signature == "" and m.content[1].text == "The answer" and m.stop_reason == "end_turn"


def test_a_streamed_message_with_tools_sends_its_blocks_whole_at_the_end(monkeypatch):
    tool = {"name": "f", "input_schema": FN}
    events = _stream_message(CALL, "qwen3", monkeypatch, tools=[tool], tool_choice={"type": "any"}, **ENABLED)
    m = _accumulated(events)
    assert [x.type for x in m.content] == ["thinking", "tool_use"] and m.content[0].thinking == 'call f with {"x": 2}'
    assert m.content[1].input == {"x": 1} and m.stop_reason == "tool_use"


# -- served: the tiny model writes no <think> -----------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning_apis")
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--reasoning-parser", "qwen3",
                      "--responses-db", str(tmp / "r.sqlite3"), log=tmp / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()


def test_served_responses_without_think_tags_have_no_reasoning_item(qwen3_server):
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="", input="Agents call tools and read JSON.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert [o.type for o in whole.output] == ["message"] and "<think>" not in whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens == 0
    with client.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert not any("reasoning" in k for k in kinds) and final.output_text == whole.output_text
    again = client.responses.create(**{**kw, "input": "And then?"}, previous_response_id=whole.id)
    assert again.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens  # the stored turn's tokens reused


def test_served_messages_without_think_tags_have_no_thinking_block(qwen3_server):
    client = anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0)
    kw = dict(model="", messages=USER, extra_body={"temperature": 0})
    text = client.messages.create(max_tokens=12, **kw).content[0].text
    found = re.search(r"[A-Za-z]{2}", text[1:])  # enabled needs max_tokens > 1024: stop early on the greedy text
    assert found, f"no two letters in the greedy text to stop on: {text!r}"
    m = client.messages.create(max_tokens=1025, stop_sequences=[found.group()], **ENABLED, **kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text[:text.find(found.group())]
    with client.messages.stream(max_tokens=12, thinking={"type": "adaptive"}, **kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text
    with pytest.raises(anthropic.BadRequestError, match=r"thinking\.budget_tokens: must be at least 1024"):
        client.messages.create(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 512}, **kw)
