"""Server pieces without a server: auth, priorities, admission, error decoding."""

from __future__ import annotations

import json

import pytest

from grammars.spec import GrammarError
from radixserve.request import InvalidParam
from radixserve.server.admission import Admission, request_priority
from radixserve.server.auth import OPEN_TENANT, Auth, Tenant, load_tenants
from radixserve.server.errors import ApiError, decode_body, value_error
from radixserve.server.protocol import ChatCompletionRequest


def test_tenant_class_caps_request_priority_and_open_servers_do_not():
    low = Tenant("batch", api_key="k", priority=0)
    assert request_priority(low, 5) == 0 and request_priority(low, None) == 0 and request_priority(low, -3) == -3
    assert request_priority(OPEN_TENANT, 5) == 5 and request_priority(OPEN_TENANT, None) == 0


def test_tenants_load_from_toml_and_json_and_bad_files_name_the_problem(tmp_path):
    (tmp_path / "t.toml").write_text('[[tenants]]\nid = "a"\napi_key = "ka"\nmax_queued_requests = 2\n')
    (tmp_path / "t.json").write_text('{"tenants": [{"id": "b", "api_key": "kb", "allow_public_prefix": true}]}')
    assert load_tenants(tmp_path / "t.toml")[0].max_queued_requests == 2
    assert load_tenants(tmp_path / "t.json")[0].allow_public_prefix
    (tmp_path / "bad.json").write_text('{"tenants": [{"id": "b", "api_key": "kb", "colour": 1}]}')
    with pytest.raises(ValueError, match="colour"):
        load_tenants(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unique"):
        Auth([Tenant("a", api_key="k"), Tenant("b", api_key="k")])


def test_auth_maps_keys_to_tenants_and_refuses_the_rest():
    auth = Auth([Tenant("a", api_key="ka"), Tenant("b", api_key="kb")])
    assert auth.authenticate("Bearer kb").id == "b"
    assert auth.authenticate(None, x_api_key="ka").id == "a"
    for header in (None, "Bearer ", "Bearer kc", "Basic ka"):
        with pytest.raises(ApiError) as e:
            auth.authenticate(header)
        assert e.value.status == 401
    assert "ka" not in repr(auth.tenants[0])


def test_admission_rejects_past_the_global_and_tenant_caps_and_releases_on_leave():
    adm = Admission(max_queued=3)
    small = Tenant("s", max_queued_requests=1)
    t1 = adm.enter(small)[0]
    with pytest.raises(ApiError) as e:
        adm.enter(small)
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    adm.enter(OPEN_TENANT, 2)
    with pytest.raises(ApiError) as e:
        adm.enter(OPEN_TENANT)
    assert e.value.status == 503
    adm.started(t1)  # first token: no longer queued
    adm.enter(OPEN_TENANT)
    adm.leave(t1)
    assert adm.queued == 3 and adm.in_flight == 3
    adm.draining = True
    with pytest.raises(ApiError, match="shutting down"):
        adm.enter(OPEN_TENANT)


def test_decoding_errors_name_the_field():
    for body, param in [(b'{"messages": 3}', "messages"), (b'{"n": "x"}', "n"), (b'{"bogus": 1}', "bogus"),
                        (b'{"messages": [{"content": "x"}]}', "messages[0].role")]:
        with pytest.raises(ApiError) as e:
            decode_body(body, ChatCompletionRequest)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)
    err = value_error(InvalidParam("max_new_tokens", "prompt + max_new_tokens = 9 exceeds 8"), {"max_new_tokens": "max_tokens"})
    assert err.param == "max_tokens" and "max_new_tokens" not in err.message
    err = value_error(GrammarError("structural_tag.structures[0]", "needs string begin and end"))
    assert err.param == "structural_tag.structures[0]" and err.message == "structural_tag.structures[0]: needs string begin and end"
    err = value_error(ValueError("not a field: a plain ValueError names none"))  # its message is never parsed for one
    assert err.status == 400 and err.param is None


def test_tool_calls_the_model_emits_are_parsed_out_of_its_text():
    from radixserve.server.chat.tools import Tool, parse_calls

    tools = [Tool("get_time", "", {"type": "object"})]
    text = 'Let me check.\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = parse_calls(text, tools)
    assert content == "Let me check." and calls[0].function.name == "get_time"
    assert calls[0].function.arguments == '{"zone": "UTC"}'
    assert parse_calls('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', tools)[1] == []  # unknown tool
    assert parse_calls("<tool_call>not json</tool_call>", tools)[1] == []


def test_a_fenced_json_call_is_a_tool_call_only_when_it_holds_nothing_but_offered_calls():
    """Qwen2.5-Coder-1.5B asked for the weather in Paris with a get_weather tool answered with
    the call in a ```json fence (seen with the real Q4_K_M file): that is a call; a fenced
    block that is code, data, or a call of a tool not offered stays content."""
    from radixserve.server.chat.tools import Tool, parse_calls

    tools = [Tool("get_weather", "", {"type": "object"}), Tool("get_time", "", {"type": "object"})]
    text = 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```'
    content, calls = parse_calls(text, tools)
    assert content == "Sure." and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    two = '```json\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]\n```'
    assert [c.function.name for c in parse_calls(two, tools)[1]] == ["get_weather", "get_time"]
    assert parse_calls(two, tools)[0] is None
    for kept in ['```json\n{"city": "Paris"}\n```', '```python\nprint(1)\n```', '```\n{"name": "rm_rf", "arguments": {}}\n```',
                 '```json\n[{"name": "get_weather", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]\n```']:
        assert parse_calls(kept, tools) == (kept, [])
    tagged = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n```json\n{"name": "get_weather", "arguments": {}}\n```'
    content, calls = parse_calls(tagged, tools)  # tags first: a fenced block beside them is the model's text
    assert [c.function.name for c in calls] == ["get_time"] and content.startswith("```json")


def test_calls_from_json_reads_only_whole_calls_a_cut_one_is_cut_calls_job():
    from radixserve.server.chat.tools import calls_from_json

    assert calls_from_json('{"name": "get_weather", "arguments": {"city": "Par') == []
    assert calls_from_json('{"name": "f", "arguments": {}}')[0].function.name == "f"


def test_each_models_tool_call_format_is_parsed_and_chosen_from_its_chat_template():
    """The formats of server.chat.tool_parsers, each as its models write it, with several calls in one
    answer; what is not a call of an offered tool stays content; the parser follows the chat
    template (a template that takes no tools gets radixserve's tagged prompt: hermes)."""
    from radixserve.server.chat import tool_parsers as tp
    from radixserve.server.chat.tools import Tool

    weather = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                                       "metric": {"type": "boolean"}}})
    tools = [weather, Tool("get_time", "", {"type": "object"})]

    def calls(fmt, text):
        content, found = tp.parse(fmt, text, tools)
        return content, [(c.function.name, json.loads(c.function.arguments)) for c in found]

    paris = ("get_weather", {"city": "Paris"})
    assert calls("hermes", 'Hm.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>') == ("Hm.", [paris, ("get_time", {})])
    assert calls("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}') == (None, [paris])
    assert calls("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}') \
        == (None, [paris, ("get_time", {})])
    assert calls("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (None, [paris])
    assert calls("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (None, [paris])  # marker skipped
    assert calls("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}') \
        == (None, [paris, ("get_time", {})])
    xml = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42 Main St\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
    assert calls("qwen3_coder", xml) == ("Checking.", [("get_weather", {"city": "42 Main St", "days": 3, "metric": True})])
    for fmt, text in [("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
                      ("llama3_json", '{"name": "Ada", "parameters": {}}'), ("llama3_json", "The answer is 4."),
                      ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
                      ("mistral", '[TOOL_CALLS]rm_rf[ARGS]{}'), ("mistral", "[1, 2]"),
                      ("qwen3_coder", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>")]:
        assert tp.parse(fmt, text, tools) == (text, []), (fmt, text)
    templates = {"hermes": "{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}",
                 "qwen3_coder": "{% for tool in tools %}<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>{% endfor %}",
                 "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
                 "llama3_json": '{% if tools %}{"name": function name, "parameters": ...}<|python_tag|>{% endif %}'}
    for fmt, template in templates.items():
        assert tp.for_template(template) == fmt
    assert tp.for_template(None) == tp.for_template("{{ messages }}") == "hermes"


def test_parallel_tool_calls_false_keeps_the_first_call():
    """parallel_tool_calls false (Anthropic: disable_parallel_tool_use) returns the model's first
    call only; the default returns every call it wrote."""
    from radixserve.server.chat import reasoning
    from radixserve.server.chat.tools import Tool

    tools = [Tool("a", "", {"type": "object"}), Tool("b", "", {"type": "object"})]
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.function.name for c in reasoning.answer(text, "stop", None, "auto", tools).calls] == ["a", "b"]
    assert [c.function.name for c in reasoning.answer(text, "stop", None, "auto", tools, one_call=True).calls] == ["a"]
