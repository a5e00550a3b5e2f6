"""`radixserve bench tools` against a scripted OpenAI-compatible server: every count is checked
against answers whose validity is known (the real-model figures are in docs/structured-outputs.md)."""

from __future__ import annotations

import asyncio
import json
import types

from aiohttp import web
from helpers import scripted_server

from radixserve.bench import tools


def _call(name: str, arguments: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def _answer(prompt: str) -> dict:
    """Weather: a valid call; flights: a call missing required fields; currency: arguments that
    are not JSON; events: an unknown tool; thermostat: left as a fenced call in the text; email:
    two valid calls; no-tool prompts: text, except the greeting, which gets a (valid) call."""
    expected = dict(tools.PROMPTS)[prompt]
    if expected == "get_weather":
        return {"content": None, "tool_calls": [_call("get_weather", '{"location": "Paris", "unit": "celsius"}')]}
    if expected == "search_flights":
        return {"content": None, "tool_calls": [_call("search_flights", '{"origin": "Boston"}')]}
    if expected == "convert_currency":
        return {"content": None, "tool_calls": [_call("convert_currency", '{"amount": 3,')]}
    if expected == "create_event":
        return {"content": None, "tool_calls": [_call("book_room", "{}")]}
    if expected == "set_thermostat":
        return {"content": '```json\n{"name": "set_thermostat", "arguments": {}}\n```', "tool_calls": None}
    if expected == "send_email":
        ok = '{"to": ["a@example.com"], "subject": "s", "body": "b"}'
        return {"content": None, "tool_calls": [_call("send_email", ok), _call("send_email", ok)]}
    if prompt.startswith("Hi!"):
        return {"content": "", "tool_calls": [_call("get_weather", '{"location": "Oslo", "unit": "fahrenheit"}')]}
    return {"content": "An answer.", "tool_calls": []}


def test_bench_tools_counts_calls_made_valid_and_text_answers_against_a_scripted_server(tmp_path, capsys):
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response({"choices": [{"message": _answer(body["messages"][-1]["content"])}]})

    async def go() -> tuple[list[str], list[tools.Tally]]:
        async with scripted_server({"/v1/chat/completions": chat}) as url:
            args = types.SimpleNamespace(url=[url, url + "/missing"], name=["a"], api_key=[], model="m",
                                         max_tokens=64, concurrency=3, limit=0)
            return await tools.bench(args)

    names, (t, broken) = asyncio.run(go())
    assert len(tools.PROMPTS) >= 40 and sum(e is not None for _, e in tools.PROMPTS) == 30
    assert len(seen) == len(tools.PROMPTS)
    assert all(b["tool_choice"] == "auto" and b["tools"] == tools.TOOLS and b["temperature"] == 0.0 for b in seen)
    assert names == ["a", "server2"]
    assert (t.tool_prompts, t.text_prompts, t.errors) == (30, 12, 0)
    assert t.calls_made == 25 and t.right_tool == 20  # thermostat made none; events named another tool
    assert (t.calls, t.calls_valid) == (5 + 5 + 5 + 5 + 10 + 1, 5 + 10 + 1)
    assert t.text_answers == 11 and t.calls_in_text == 5
    by_prompt = {a["prompt"]: a for a in t.answers}
    assert by_prompt["Convert 250 US dollars to euros."]["problems"] == ["arguments are not JSON"]
    assert "required property" in by_prompt[tools.PROMPTS[5][0]]["problems"][0]
    assert broken.errors == len(tools.PROMPTS) and broken.calls == 0
    tools.print_table(names, [t, broken])
    table = capsys.readouterr().out
    assert "| calls made | 25/30 (83 %) | 0/30 (0 %) |" in table
    assert "| calls valid | 16/31 (52 %) | - |" in table


def test_check_call_validates_nested_and_enum_arguments():
    flights = {"origin": "Rome", "destination": "Oslo", "date": "2026-01-01",
               "passengers": {"adults": 1, "children": 0}, "cabin": "economy"}
    assert tools.check_call({"function": {"name": "search_flights", "arguments": json.dumps(flights)}}) is None
    bad = {**flights, "passengers": {"adults": 0, "children": 0}}
    assert "minimum" in tools.check_call({"function": {"name": "search_flights", "arguments": json.dumps(bad)}})
    assert "is not one of" in tools.check_call(
        {"function": {"name": "get_weather", "arguments": '{"location": "x", "unit": "kelvin"}'}})
