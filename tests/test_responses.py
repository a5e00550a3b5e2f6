"""The OpenAI Responses API (/v1/responses) through the official openai client, on a real server
(the tiny random model: its text is noise, so validity is checked where output is constrained):
create, stream, parse, function tools, stored responses across a restart with the prefix cache
hit by the continued turn, and tenants that cannot see each other's responses."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from server_helpers import scaled

TENANTS = '[[tenants]]\nid = "alice"\napi_key = "key-alice"\n\n[[tenants]]\nid = "bob"\napi_key = "key-bob"\n'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}}
ASK = "Agents call tools, read JSON, and branch into many parallel calls. The quick brown fox jumps over the lazy dog."


class Servers:
    """One server per module, restartable on the same --responses-db file."""

    def __init__(self, model: Path, tmp: Path) -> None:
        (tmp / "tenants.toml").write_text(TENANTS)
        self.args = ("--kv-cache-tokens", "8192", "--tenants", str(tmp / "tenants.toml"), "--responses-db", str(tmp / "r.sqlite3"))
        self.model, self.tmp, self.starts = model, tmp, 0
        self.server = self._start()

    def _start(self):
        from server_helpers import ServerProcess

        self.starts += 1
        return ServerProcess(self.model, *self.args, log=self.tmp / f"server{self.starts}.log")

    def restart(self) -> None:
        """SIGTERM the running server, then start a new process (the old one exits meanwhile)."""
        old = self.server
        old.proc.send_signal(signal.SIGTERM)
        self.server = self._start()
        # wait, never signal again: a second SIGTERM while it exits kills it (-15), as it did when
        # the new server was ready first
        assert old.proc.wait(scaled(60)) == 0, old.log.read_text()

    def client(self, key: str = "key-alice"):
        import openai

        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Servers(tiny_llama, tmp_path_factory.mktemp("responses"))
    yield s
    assert s.server.stop() == 0, s.server.log.read_text()


def _error(servers: Servers, body: dict, key: str = "key-alice") -> tuple[int, str | None, str]:
    status, out = servers.server.post("/v1/responses", {"input": "hi", "max_output_tokens": 4, **body}, key)
    return status, out.get("error", {}).get("param"), out.get("error", {}).get("message", "")


def test_create_with_string_and_item_input(servers: Servers) -> None:
    c = servers.client()
    r = c.responses.create(model="", input=ASK, instructions="Be brief.", max_output_tokens=8, temperature=0,
                           metadata={"k": "v"}, truncation="auto", include=[], reasoning={}, service_tier="auto",
                           prompt_cache_key="x", safety_identifier="s", user="u")
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_") and isinstance(r.output_text, str)
    assert (r.instructions, r.metadata, r.temperature, r.max_output_tokens, r.store) == ("Be brief.", {"k": "v"}, 0, 8, True)
    assert r.usage.output_tokens <= 8 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Oui.", "annotations": []}]},
             {"role": "user", "content": "Encore?"}]
    r2 = c.responses.create(model="", input=items, max_output_tokens=8, temperature=0)
    assert r2.usage.input_tokens > r.usage.input_tokens and isinstance(r2.output_text, str)


def test_stream_events_come_in_order_and_deltas_make_the_text(servers: Servers) -> None:
    c = servers.client()
    events = list(c.responses.create(model="", input=ASK, max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:-1] == tail and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) <= {"response.output_text.delta"} and len(kinds) > 8
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text and text
    assert final.status == ("completed" if kinds[-1] == "response.completed" else "incomplete")
    assert c.responses.retrieve(final.id).output_text == text


def test_parse_validates_against_the_pydantic_model(servers: Servers) -> None:
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        city: str = Field(max_length=10)
        rank: int = Field(ge=0, le=99)  # bounded, so a random model's answer fits max_output_tokens
        sunny: bool

    r = servers.client().responses.parse(model="", input=ASK, text_format=Answer, max_output_tokens=200, temperature=0)
    assert isinstance(r.output_parsed, Answer), r.output_text
    assert r.text.format.type == "json_schema" and r.text.format.strict is True
    with servers.client().responses.stream(model="", input=ASK, text_format=Answer, max_output_tokens=200) as stream:
        assert isinstance(stream.get_final_response().output_parsed, Answer)  # the client's stream helper too
    o = servers.client().responses.create(model="", input=ASK, text={"format": {"type": "json_object"}}, max_output_tokens=8)
    assert o.output_text.startswith("{") and o.text.format.type == "json_object"
    bad = {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}}
    fmt = {"format": {"type": "json_schema", "name": "b", "schema": bad, "strict": True}}
    status, param, message = _error(servers, {"text": fmt})
    assert status == 400 and param == "text.format" and "oneOf" in message  # strict: refused, as chat refuses it


def test_required_tool_call_validates_and_round_trips(servers: Servers) -> None:
    import jsonschema

    c = servers.client()
    r = c.responses.create(model="", input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=100, temperature=0)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and r.tools[0].name == "get_weather" and r.tool_choice == "required"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    named = c.responses.create(model="", input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=100, temperature=0)
    assert named.output[0].type == "function_call"
    back = [{"role": "user", "content": ASK}, *r.output,  # the output items go back as they came
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    done = c.responses.create(model="", input=back, tools=[WEATHER], tool_choice="auto", max_output_tokens=8, temperature=0)
    assert done.output[0].type == "message" and done.usage.input_tokens > r.usage.input_tokens
    cont = c.responses.create(model="", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8, temperature=0,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert cont.previous_response_id == r.id and cont.usage.input_tokens_details.cached_tokens > 0
    events = [e.type for e in c.responses.create(model="", input=ASK, tools=[WEATHER], tool_choice="required",
                                                  max_output_tokens=100, temperature=0, stream=True)]
    assert events[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]


def _turn(c, prev: str | None, text: str):
    return c.responses.create(model="", input=text, instructions="You are terse.", previous_response_id=prev,
                              max_output_tokens=16, temperature=0)


def test_a_tool_from_a_nested_pydantic_model_is_called_with_valid_arguments(servers: Servers) -> None:
    """Its schema has $defs (one model inside another): they must resolve inside the call."""
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=12)
        zip: int = Field(ge=0, le=99999)

    class Ship(BaseModel):
        to: Address
        back: Address | None = None

    schema = Ship.model_json_schema()
    assert "$defs" in schema
    tool = {"type": "function", "name": "ship", "description": "Ship a parcel", "parameters": schema}
    r = servers.client().responses.create(model="", input=ASK, tools=[tool], tool_choice="required", max_output_tokens=150,
                                          temperature=0)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "ship" and isinstance(Ship.model_validate_json(call.arguments), Ship)


def test_continuation_hits_the_prefix_cache_and_survives_a_restart(servers: Servers) -> None:
    r1 = _turn(servers.client(), None, ASK)
    r2 = _turn(servers.client(), r1.id, "And then?")
    u1, u2 = r1.usage, r2.usage
    assert u2.input_tokens > u1.input_tokens + u1.output_tokens  # the history is in the prompt
    # the whole first turn (its prompt, and its output but the last token, whose KV is never computed) is cached
    assert u2.input_tokens_details.cached_tokens >= u1.input_tokens + u1.output_tokens - 1
    assert u2.input_tokens_details.cached_tokens >= 0.5 * u2.input_tokens
    servers.restart()
    c = servers.client()
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
    r3 = _turn(c, r2.id, "Why?")  # from the file: a fresh cache, the stored conversation
    assert r3.usage.input_tokens > u2.input_tokens + u2.output_tokens
    r4 = _turn(c, r3.id, "Sure?")
    u3, u4 = r3.usage, r4.usage
    assert u4.input_tokens_details.cached_tokens >= u3.input_tokens + u3.output_tokens - 1
    assert u4.input_tokens_details.cached_tokens >= 0.5 * u4.input_tokens


def test_retrieve_delete_and_list_input_items(servers: Servers) -> None:
    import openai

    c = servers.client()
    items = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    r = c.responses.create(model="", input=items, max_output_tokens=4, temperature=0)
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    listed = c.responses.input_items.list(r.id, order="asc")
    assert [i.role for i in listed.data] == ["user", "assistant", "user"] and listed.has_more is False
    assert listed.data[0].content[0].text == "one" and listed.data[1].content[0].type == "output_text"
    page = c.responses.input_items.list(r.id, limit=2)  # desc by default, as OpenAI
    assert page.has_more and [i.content[0].text for i in page.data] == ["three", "two"] and page.last_id == page.data[-1].id
    assert [i.content[0].text for i in c.responses.input_items.list(r.id, limit=1, order="asc")] == ["one", "two", "three"]
    c.responses.delete(r.id)
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = c.responses.create(model="", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_a_tenant_cannot_read_continue_or_delete_another_tenants_response(servers: Servers) -> None:
    r = servers.client("key-alice").responses.create(model="", input="mine", max_output_tokens=2)
    s = servers.server
    for rid in (r.id, "resp_" + "0" * 32):  # another tenant's id answers exactly as a missing one
        answers = [s.get(f"/v1/responses/{rid}", "key-bob"), s.get(f"/v1/responses/{rid}/input_items", "key-bob"),
                   _delete(s, rid, "key-bob"), s.post("/v1/responses", {"input": "x", "previous_response_id": rid}, "key-bob")]
        assert [a[0] for a in answers] == [404] * 4, answers
        messages = [a[1]["error"]["message"].replace(rid, "ID") for a in answers]
        if rid == r.id:
            first = messages
        else:
            assert messages == first
    assert servers.client("key-alice").responses.retrieve(r.id).id == r.id  # bob's delete did nothing


def _delete(s, rid: str, key: str) -> tuple[int, dict]:
    import urllib.request

    req = urllib.request.Request(f"{s.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"}, method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,param", [
    ({"bogus": 1}, "bogus"),
    ({"input": ""}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),  # a reasoning item is accepted: see test_reasoning_apis
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"model": "gpt-9"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(servers: Servers, body: dict, param: str) -> None:
    status, got, message = _error(servers, body)
    assert (status, got) == (400 if param != "model" else 404, param), message
    assert message.startswith(param), message


def test_bad_list_arguments_name_the_field(servers: Servers) -> None:
    r = servers.client().responses.create(model="", input="hi", max_output_tokens=2)
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=nope", "after")):
        status, out = servers.server.get(f"/v1/responses/{r.id}/input_items?{query}", "key-alice")
        assert (status, out["error"]["param"]) == (400, param), out


def test_a_failed_stream_ends_with_error_and_response_failed_events() -> None:
    """The events a generation error sends, checked against the openai client's own types."""
    import asyncio

    import pydantic
    from helpers import Sink
    from openai.types.responses import ResponseStreamEvent

    from radixserve.server.responses.protocol import ResponseObject
    from radixserve.server.responses.stream import EventWriter

    resp = ResponseObject("resp_x", 0, "m", "in_progress", [], None, [], "auto", {"format": {"type": "text"}}, 1.0, 1.0,
                          None, None, {}, True, True)
    sink = Sink()
    w = EventWriter(sink, 5.0)
    asyncio.run(w.start(resp))
    asyncio.run(w.open_message(0, "msg_x"))
    asyncio.run(w.fail(resp, "server_error", "boom"))
    blocks = [b.split("\n") for b in sink.data.decode().strip().split("\n\n")]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_json(lines[1].removeprefix("data: ")) for lines in blocks]
    assert [lines[0] for lines in blocks] == [f"event: {e.type}" for e in events]
    assert [e.type for e in events][-2:] == ["error", "response.failed"] and events[-2].message == "boom"
    assert events[-1].response.status == "failed" and events[-1].response.error.message == "boom"


def test_the_store_keeps_at_most_the_cap_per_tenant_dropping_the_oldest(tmp_path: Path) -> None:
    from radixserve.server.responses.store import ResponseStore, StoredResponse

    store = ResponseStore(lambda: tmp_path / "r.sqlite3", lambda: 2)
    for i, tenant in enumerate(["a", "a", "b", "a"]):
        store.put(StoredResponse(f"resp_{i}", tenant, 1000 + i, b"{}", b"[]", b""))
    assert [store.get("a", f"resp_{i}") is not None for i in (0, 1, 3)] == [False, True, True]
    assert store.get("b", "resp_2") is not None  # another tenant's count is its own
    store.close()


def test_a_tenant_id_issued_again_with_a_new_key_reads_none_of_the_old_owners_responses(servers: Servers) -> None:
    """The store was keyed by tenant id alone: "alice" given to someone new, with a new key, read
    and continued the old alice's conversations (the prefix cache's namespaces already hold the key)."""
    import openai

    r = _turn(servers.client(), None, ASK)
    (servers.tmp / "tenants.toml").write_text(TENANTS.replace("key-alice", "key-alice-2"))
    servers.restart()  # the module's last test: the server keeps the new tenants file
    new = servers.client("key-alice-2")
    for call in (lambda: new.responses.retrieve(r.id), lambda: _turn(new, r.id, "And then?")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert new.responses.retrieve(_turn(new, None, ASK).id).output_text  # its own are kept
