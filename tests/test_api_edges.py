"""Edges an outside review of the three chat-like APIs found: a tool's schema error names that
tool's own field in each API's shape, unknown keys inside a tool are a 400, a strict tool is
held to strict mode, and inputs the real APIs refuse are refused here too, naming the field."""

from __future__ import annotations

BROKEN = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}
REMOTE = {"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}}
FINE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "hi"}]


def _chat_tool(name: str, params: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params, **extra}}


def test_a_broken_ref_names_the_tool_in_each_apis_own_field(server):
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tool_choice": "required",
                                                         "tools": [_chat_tool("ok", FINE), _chat_tool("f", BROKEN)]})
    assert status == 400 and body["error"]["param"] in ("tools", "tools[1].function.parameters"), body
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tool_choice": "required",
                                                         "tools": [_chat_tool("f", BROKEN)]})
    assert status == 400 and body["error"]["param"] == "tools[0].function.parameters", body
    status, body = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 2, "tool_choice": "required",
                                                 "tools": [{"type": "function", "name": "f", "parameters": BROKEN}]})
    assert status == 400 and body["error"]["param"] == "tools[0].parameters", body
    assert "#/$defs/Nope" in body["error"]["message"] and "arguments" not in body["error"]["message"]
    status, body = server.post("/v1/messages", {"model": "", "max_tokens": 2, "messages": USER, "tool_choice": {"type": "any"},
                                                "tools": [{"name": "f", "input_schema": BROKEN}]})
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["message"].startswith("tools[0].input_schema: "), body


def test_unknown_keys_inside_a_tool_are_a_400_naming_them(server):
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                         "tools": [_chat_tool("f", FINE, foo=1)]})
    assert status == 400 and body["error"]["param"] == "tools[0].function.foo", body
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                         "tools": [{**_chat_tool("f", FINE), "bar": 2}]})
    assert status == 400 and body["error"]["param"] == "tools[0].bar", body
    status, body = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                 "tools": [{"type": "function", "name": "f", "parameters": FINE, "foo": 1}]})
    assert status == 400 and body["error"]["param"] == "tools[0].foo", body


def test_a_strict_tool_is_held_to_strict_mode(server):
    """As a strict response_format: a schema the grammar cannot fully enforce is refused."""
    tool = _chat_tool("f", REMOTE, strict=True)
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tool_choice": "required", "tools": [tool]})
    assert status == 400 and body["error"]["param"] == "tools[0].function.parameters", body
    assert "cannot be enforced" in body["error"]["message"]
    tool["function"]["strict"] = False  # not strict: compiled as well as the backend can, as before
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tool_choice": "required", "tools": [tool]})
    assert status == 200, body


def test_inputs_the_real_apis_refuse_name_the_field(server):
    status, body = server.post("/v1/messages", {"model": "", "max_tokens": 5, "messages": [{"role": "assistant", "content": "hi"}]})
    assert status == 400 and body["error"]["message"].startswith("messages[0].role: "), body
    status, body = server.post("/v1/messages", {"model": "", "max_tokens": 5,
                                                "messages": [*USER, {"role": "system", "content": "x"}]})
    assert status == 400 and body["error"]["message"].startswith("messages[1].role: "), body
    status, body = server.post("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]})
    assert status == 400 and body["error"]["param"] == "input[0].content[0].text", body


def test_auto_tool_calls_are_constrained_so_a_broken_schema_names_the_tool(server):
    """tool_choice auto constrains the calls (server.chat.tools.auto_tag): a tool schema the grammar
    cannot compile is a 400 naming that tool in each API's shape, as for a required call; a
    schema it compiles only in part (a remote $ref, not strict) still serves."""
    status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tool_choice": "auto",
                                                         "tools": [_chat_tool("ok", FINE), _chat_tool("f", BROKEN)]})
    assert status == 400 and body["error"]["param"] == "tools[1].function.parameters", body
    assert "#/$defs/Nope" in body["error"]["message"] and "arguments" not in body["error"]["message"]
    status, body = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                 "tools": [{"type": "function", "name": "f", "parameters": BROKEN}]})
    assert status == 400 and body["error"]["param"] == "tools[0].parameters", body
    status, body = server.post("/v1/messages", {"model": "", "max_tokens": 2, "messages": USER,
                                                "tools": [{"name": "f", "input_schema": BROKEN}]})
    assert status == 400 and body["error"]["message"].startswith("tools[0].input_schema: "), body
    for tools in ([_chat_tool("f", REMOTE)], [_chat_tool("ok", FINE)]):
        status, body = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tools": tools})
        assert status == 200, body
