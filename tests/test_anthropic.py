"""The Anthropic Messages API (/v1/messages) against a real server, through the official
`anthropic` SDK. The tiny model's text is random: greedy (temperature 0) runs are compared with
each other, and tool calls are constrained by tool_choice where validity matters."""

from __future__ import annotations

import json
import re
import urllib.request

import anthropic
import msgspec
import pytest
from conftest import CORPUS
from server_helpers import MAX_BODY, ServerProcess

from radixserve.server.anthropic.protocol import MessagesRequest

GREEDY = {"temperature": 0}  # this SDK's messages.create has no temperature argument: sent as an extra body field
USER = [{"role": "user", "content": "Agents call tools and read JSON."}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                             "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server.get("/v1/models")[1]["data"][0]["id"]


def test_a_message_has_text_usage_and_a_stop_reason(client, model):
    m = client.messages.create(model=model, max_tokens=8, messages=USER, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("max_tokens", "end_turn") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 8 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 5
    assert m.usage.cache_creation_input_tokens == 0
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 8


def test_system_as_a_string_or_as_text_blocks_is_the_same_prompt(client, model):
    kw = dict(model=model, max_tokens=8, messages=USER, extra_body=GREEDY)
    as_text = client.messages.create(system="You are terse.", **kw)
    as_blocks = client.messages.create(system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}], **kw)
    assert as_text.content[0].text == as_blocks.content[0].text
    n_text = client.messages.count_tokens(model=model, system="You are terse.", messages=USER).input_tokens
    n_none = client.messages.count_tokens(model=model, messages=USER).input_tokens
    assert n_text > n_none


def test_a_stop_sequence_ends_the_text_before_it_and_is_reported(client, model):
    fox = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    kw = dict(model=model, max_tokens=24, messages=fox, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    found = re.search(r"[A-Za-z]{2}", text[1:])  # the random text holds partial UTF-8 (shown as U+FFFD): stop on letters
    assert found, f"no two letters in the greedy text to stop on: {text!r}"
    stop = found.group()
    m = client.messages.create(stop_sequences=["never-seen-zzz", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.find(stop)]


def test_streaming_events_come_in_order_and_add_up_to_the_final_message(client, model, server):
    kw = dict(model=model, max_tokens=12, messages=USER, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    raw = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) <= {"content_block_delta"}
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    prompt = [u.input_tokens + u.cache_read_input_tokens for u in (final.usage, whole.usage)]
    assert prompt[0] == prompt[1]
    raw = {"model": model, "max_tokens": 12, "messages": USER, "stream": True, **GREEDY}
    # on the wire: each `data:` follows an `event:` line naming its type, a ping included, no [DONE]
    req = urllib.request.Request(server.url + "/v1/messages", data=json.dumps(raw).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read().decode()
    frames = [f.split("\n") for f in body.strip().split("\n\n")]
    assert all(f[0].startswith("event: ") and json.loads(f[1].removeprefix("data: "))["type"] == f[0][7:] for f in frames)
    assert "ping" in [f[0][7:] for f in frames] and "[DONE]" not in body


def test_a_forced_tool_call_validates_and_its_result_gets_an_answer(client, model):
    import jsonschema

    m = client.messages.create(model=model, max_tokens=160, messages=USER, tools=[WEATHER, TIME], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use", m
    call = m.content[-1]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = [*USER, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    answer = client.messages.create(model=model, max_tokens=8, messages=history, tools=[WEATHER, TIME], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    with client.messages.stream(model=model, max_tokens=160, messages=USER, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "any"}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


def test_output_config_format_constrains_the_answer_to_a_json_schema(client, model):
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    m = client.messages.create(model=model, max_tokens=64, messages=USER, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_count_tokens_is_the_prompt_a_message_reads(client, model):
    kw = dict(model=model, messages=USER, tools=[WEATHER], tool_choice={"type": "auto"})
    counted = client.messages.count_tokens(**kw).input_tokens
    assert counted > client.messages.count_tokens(model=model, messages=USER).input_tokens  # the tools are in it
    m = client.messages.create(max_tokens=1, **kw)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_a_repeated_long_system_prompt_is_read_from_the_cache(client, model):
    system = " ".join(CORPUS) * 2
    kw = dict(model=model, max_tokens=2, system=system, extra_body=GREEDY)
    client.messages.create(messages=[{"role": "user", "content": "first question"}], **kw)
    second = client.messages.create(messages=[{"role": "user", "content": "another one"}], **kw)
    assert second.usage.cache_read_input_tokens > 0


def test_cache_control_breakpoints_split_the_usage_as_anthropic_does(client, model):
    """input + cache read + cache creation = the prompt; the first call writes what its breakpoints
    cover (by TTL), the next reads it; a breakpoint after a system block covers at least that."""
    # a system text no other test sends: none of it is cached before the first call
    system = [{"type": "text", "text": "Breakpoints. " + " ".join(CORPUS), "cache_control": {"type": "ephemeral", "ttl": "1h"}},
              {"type": "text", "text": " ".join(reversed(CORPUS)), "cache_control": {"type": "ephemeral"}}]
    kw = dict(model=model, max_tokens=2, system=system, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=model, system=system, messages=USER).input_tokens
    first = client.messages.create(messages=USER, **kw).usage
    assert first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens == counted
    # read: at most the chat template's head, which earlier calls left in the cache
    assert first.cache_read_input_tokens < 16 and first.cache_creation_input_tokens > 40
    assert first.cache_creation.ephemeral_1h_input_tokens > 10 and first.cache_creation.ephemeral_5m_input_tokens > 10
    assert first.cache_creation.ephemeral_1h_input_tokens + first.cache_creation.ephemeral_5m_input_tokens \
        == first.cache_creation_input_tokens
    again = client.messages.create(messages=[{"role": "user", "content": "Another question entirely."}], **kw).usage
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens and again.cache_creation_input_tokens == 0
    marked = [{"role": "user", "content": [{"type": "text", "text": "Agents call tools.", "cache_control": {"type": "ephemeral"}},
                                           {"type": "text", "text": "And then they read JSON."}]}]
    m = client.messages.create(model=model, max_tokens=2, messages=marked, extra_body=GREEDY).usage
    assert 0 < m.cache_creation_input_tokens < m.input_tokens + m.cache_creation_input_tokens
    for bad, where in (({"type": "ephemeral", "ttl": "2h"}, "system[0].cache_control.ttl"),
                       ({"type": "persistent"}, "system[0].cache_control.type")):
        with pytest.raises(anthropic.BadRequestError, match=re.escape(where)):
            client.messages.create(model=model, max_tokens=2, messages=USER,
                                   system=[{"type": "text", "text": "x", "cache_control": bad}])
    five = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="at most 4"):
        client.messages.create(model=model, max_tokens=2, messages=USER, system=five)


def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(client, model, server):
    status, body = server.post("/v1/messages", {"model": model, "messages": USER})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("max_tokens")
    status, body = server.post("/v1/messages", {"model": model, "max_tokens": 0, "messages": USER})
    assert status == 400 and body["error"]["message"].startswith("max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=4, messages=[
            *USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    assert e.value.body["error"]["message"].startswith("messages[2].content[1].type: image blocks are not supported")
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model=model, max_tokens=4, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match=r"tool_choice\.name: no tool is named 'nope'"):
        client.messages.create(model=model, max_tokens=4, messages=USER, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.type"):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x",
                                                                                          "name": "get_weather", "input": {}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    status, body = server.get("/v1/messages")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = server.post("/v1/messages", b"x" * (MAX_BODY + 1))
    assert status == 413 and body["error"]["type"] == "request_too_large"


def test_tool_history_and_results_become_the_chat_paths_messages():
    from radixserve.server.anthropic.convert import conversation
    from radixserve.server.chat import core as chat_core

    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "C"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [{"type": "text", "text": "timeout"}]}
    body = {"model": "m", "max_tokens": 4, "system": "Be brief.", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
        {"role": "user", "content": [result, {"type": "text", "text": "Try again."}]}, {"role": "assistant", "content": "It is"}]}
    conv = conversation(msgspec.json.decode(json.dumps(body), type=MessagesRequest))
    history = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'
    assert conv.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.\n" + history},
        {"role": "tool", "content": "Error: timeout"}, {"role": "user", "content": "Try again."}]
    assert conv.prefill == "It is" and conv.mode == "auto" and [t.name for t in conv.offered] == ["get_weather"]
    silent = conversation(msgspec.json.decode(json.dumps({**body, "tool_choice": {"type": "none"}}), type=MessagesRequest))
    assert silent.mode == "none" and chat_core.constrain(silent, None).offered == []  # the core offers none


def test_the_routes_wire_types_make_a_json_schema():
    from radixserve.server.anthropic.routes import OPENAPI_ROUTES

    types = [t for route in OPENAPI_ROUTES for t in route[2:4] if t is not None]
    assert len(types) == 4 and msgspec.json.schema_components(types)[1]["MessagesRequest"]["required"]


def test_a_wrong_api_key_is_a_401_authentication_error(tiny_llama, tmp_path):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "2048", "--api-key", "sk-right", log=tmp_path / "server.log")
    try:
        name = s.get("/v1/models", "sk-right")[1]["data"][0]["id"]
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="sk-wrong", max_retries=0).messages.create(
                model=name, max_tokens=2, messages=USER)
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        ok = anthropic.Anthropic(base_url=s.url, api_key="sk-right", max_retries=0)  # the SDK sends x-api-key
        assert ok.messages.count_tokens(model=name, messages=USER).input_tokens > 0
    finally:
        assert s.stop() == 0, (tmp_path / "server.log").read_text()
