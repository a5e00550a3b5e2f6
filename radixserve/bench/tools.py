"""`radixserve bench tools --url A --name a --url B --name b`: tool use in `tool_choice: "auto"`,
the same fixed prompts against any OpenAI-compatible chat servers side by side.

Six tools (flat, enum, nested-object, array-of-object and number parameters) are offered with
every prompt; 30 prompts have a tool that fits, 12 have none (a greeting, arithmetic, a
poem...). Greedy, each prompt once per server. Per server:

    calls made      tool prompts answered with at least one tool call
    right tool      tool prompts whose first call names the expected tool
    calls valid     calls (on any prompt) whose arguments parse and validate against the
                    called tool's JSON schema, of all calls made; a call naming no offered
                    tool is invalid
    text answers    no-tool prompts answered in text (content, no call)
    calls in text   answers whose content still holds an offered tool's name as a JSON
                    "name" (a call the server did not parse, e.g. in a ```json fence)
    errors          requests that did not answer 200

Validation uses `jsonschema` (in the `test` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixserve.bench import bearer

_CITY = {"type": "string", "description": "a city name, e.g. Paris"}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "location": _CITY, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Search flights between two cities on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": _CITY, "destination": _CITY,
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "passengers": {"type": "object", "properties": {
                "adults": {"type": "integer", "minimum": 1, "maximum": 9},
                "children": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["adults", "children"], "additionalProperties": False},
            "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]}},
            "required": ["origin", "destination", "date", "passengers", "cabin"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "create_event", "description": "Put a meeting in the calendar.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"},
            "start": {"type": "string", "description": "ISO 8601 date and time"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name"], "additionalProperties": False}}},
            "required": ["title", "start", "duration_minutes", "attendees"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0},
            "from_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
            "to_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}},
            "required": ["amount", "from_currency", "to_currency"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_thermostat", "description": "Set a room's thermostat.",
        "parameters": {"type": "object", "properties": {
            "room": {"type": "string", "enum": ["living_room", "bedroom", "kitchen", "office"]},
            "temperature": {"type": "number", "minimum": 10, "maximum": 30},
            "mode": {"type": "string", "enum": ["heat", "cool", "auto"]}},
            "required": ["room", "temperature", "mode"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "subject": {"type": "string"}, "body": {"type": "string"},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]}},
            "required": ["to", "subject", "body"], "additionalProperties": False}}},
]

# (prompt, the tool that fits or None)
PROMPTS: list[tuple[str, str | None]] = [
    ("What's the weather in Paris in celsius?", "get_weather"),
    ("Is it raining in Tokyo right now? Give me the temperature in fahrenheit.", "get_weather"),
    ("How warm is it in Cape Town today, in degrees Celsius?", "get_weather"),
    ("Check the weather for Chicago, Fahrenheit please.", "get_weather"),
    ("I'm packing for Oslo. What's the weather there (celsius)?", "get_weather"),
    ("Find economy flights from Boston to Denver on 2026-03-14 for 2 adults and 1 child.", "search_flights"),
    ("Search business class flights from London to Singapore on 2026-07-01 for one adult, no children.", "search_flights"),
    ("I need first class seats Madrid to Rome, 2026-05-20, 2 adults, 0 children.", "search_flights"),
    ("Look up premium economy flights from Sydney to Auckland on 2026-12-24: 2 adults and 3 kids.", "search_flights"),
    ("Any economy flights Berlin to Lisbon on 2026-09-09 for 4 adults?", "search_flights"),
    ("Schedule a 30 minute meeting called 'Budget review' on 2026-02-03T10:00 with Alice (alice@example.com).", "create_event"),
    ("Put 'Team lunch' in my calendar for 2026-04-10T12:30, 90 minutes, with Bob and Carol.", "create_event"),
    ("Create an hour-long event 'Design sync' at 2026-06-01T15:00 with Dana (dana@example.com) and Eli.", "create_event"),
    ("Book a 45-minute '1:1 with Sam' on 2026-01-15T09:00, attendee Sam.", "create_event"),
    ("Add a two-hour 'Offsite planning' session at 2026-08-20T13:00 with Fay, Gus and Hana.", "create_event"),
    ("Convert 250 US dollars to euros.", "convert_currency"),
    ("How much is 1000 JPY in GBP?", "convert_currency"),
    ("Change 75.5 Swiss francs into US dollars.", "convert_currency"),
    ("What do 12,000 euros come to in yen?", "convert_currency"),
    ("Convert 40 pounds sterling to Swiss francs.", "convert_currency"),
    ("Set the bedroom to 19 degrees on heat.", "set_thermostat"),
    ("Cool the office down to 22 degrees.", "set_thermostat"),
    ("Put the living room thermostat on auto at 21.5.", "set_thermostat"),
    ("Make the kitchen 24 degrees, heating mode.", "set_thermostat"),
    ("Set the office thermostat to 20 in auto mode.", "set_thermostat"),
    ("Email bob@example.com with subject 'Report' saying the Q3 report is attached.", "send_email"),
    ("Send a high priority email to ops@example.com and cto@example.com: subject 'Outage', body 'The API is down.'", "send_email"),
    ("Write an email to carol@example.com, subject 'Lunch?', asking if she is free on Friday.", "send_email"),
    ("Send low priority mail to team@example.com titled 'Snacks' saying new snacks are in the kitchen.", "send_email"),
    ("Email dave@example.com: subject 'Thanks', body 'Thanks for the help yesterday!'", "send_email"),
    ("Hi! How are you today?", None),
    ("What is 17 times 23?", None),
    ("Write a haiku about autumn leaves.", None),
    ("What is the capital of Canada?", None),
    ("Explain in one sentence what a linked list is.", None),
    ("Translate 'good morning' into Spanish.", None),
    ("Tell me a short joke about programmers.", None),
    ("Who wrote 'Pride and Prejudice'?", None),
    ("Give me three tips for better sleep.", None),
    ("What does HTTP stand for?", None),
    ("Summarize the plot of Romeo and Juliet in two sentences.", None),
    ("Thanks, that's all I needed!", None),
]
_NAMED = re.compile(r'"name"\s*:\s*"(' + "|".join(t["function"]["name"] for t in TOOLS) + ')"')
SYSTEM = "You are a helpful assistant. Use a tool when one fits the request; otherwise answer directly."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", required=True, help="a server's base URL (repeat: servers side by side)")
    p.add_argument("--name", action="append", default=[], help="a name per --url, in order")
    p.add_argument("--api-key", action="append", default=[], help="a key per --url, in order ('' for none)")
    p.add_argument("--model", default="", help="the model name to send (most single-model servers ignore it)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    p.add_argument("--limit", type=int, default=0, help="only the first N tool prompts and N/2 no-tool ones (smoke runs)")
    p.add_argument("--json", default=None, help="write the figures and every answer to this file")


@dataclass
class Tally:
    tool_prompts: int = 0
    calls_made: int = 0
    right_tool: int = 0
    calls: int = 0
    calls_valid: int = 0
    text_prompts: int = 0
    text_answers: int = 0
    calls_in_text: int = 0
    errors: int = 0
    answers: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "answers"}


def check_call(call: dict[str, Any]) -> str | None:
    """Why a tool call is invalid (None: it names an offered tool and its arguments validate)."""
    import jsonschema

    fn = call.get("function") or {}
    spec = next((t["function"] for t in TOOLS if t["function"]["name"] == fn.get("name")), None)
    if spec is None:
        return f"no tool named {fn.get('name')!r}"
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return "arguments are not JSON"
    try:
        jsonschema.validate(args, spec["parameters"])
    except jsonschema.ValidationError as e:
        return f"arguments: {e.message}"
    return None


def score(t: Tally, expected: str | None, message: dict[str, Any]) -> dict[str, Any]:
    """Count one answer into the tally; returns what is kept of it."""
    calls = message.get("tool_calls") or []
    problems = [check_call(c) for c in calls]
    t.calls += len(calls)
    t.calls_in_text += int(bool(_NAMED.search(message.get("content") or "")))
    t.calls_valid += problems.count(None)
    if expected is None:
        t.text_prompts += 1
        t.text_answers += int(not calls and bool((message.get("content") or "").strip()))
    else:
        t.tool_prompts += 1
        t.calls_made += int(bool(calls))
        t.right_tool += int(bool(calls) and (calls[0].get("function") or {}).get("name") == expected)
    return {"expected": expected, "content": message.get("content"),
            "calls": [c.get("function") for c in calls], "problems": [p for p in problems if p]}


async def ask(session: Any, url: str, key: str | None, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            "tools": TOOLS, "tool_choice": "auto", "temperature": 0.0, "max_tokens": max_tokens}
    async with session.post(url.rstrip("/") + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {str(data)[:200]}")
    return data["choices"][0]["message"]


async def run_server(session: Any, url: str, key: str | None, args: argparse.Namespace,
                     prompts: list[tuple[str, str | None]]) -> Tally:
    t = Tally()
    gate = asyncio.Semaphore(max(1, args.concurrency))

    async def one(prompt: str, expected: str | None) -> None:
        async with gate:
            try:
                message = await ask(session, url, key, args.model, prompt, args.max_tokens)
            except Exception as e:  # a refused or broken request is counted (a prompt with no call), and the run goes on
                t.errors += 1
                t.tool_prompts += expected is not None
                t.text_prompts += expected is None
                t.answers.append({"prompt": prompt, "expected": expected, "error": str(e)})
                return
        t.answers.append({"prompt": prompt, **score(t, expected, message)})

    await asyncio.gather(*(one(p, e) for p, e in prompts))
    return t


def chosen_prompts(limit: int) -> list[tuple[str, str | None]]:
    if limit <= 0:
        return PROMPTS
    with_tool = [p for p in PROMPTS if p[1] is not None][:limit]
    return with_tool + [p for p in PROMPTS if p[1] is None][: max(1, limit // 2)]


def print_table(names: list[str], tallies: list[Tally]) -> None:
    def pct(a: int, b: int) -> str:
        return f"{a}/{b} ({100 * a / b:.0f} %)" if b else "-"

    print(f"\n| | {' | '.join(names)} |")
    print("|---|" + "---|" * len(names))
    rows = [("calls made", lambda t: pct(t.calls_made, t.tool_prompts)),
            ("right tool", lambda t: pct(t.right_tool, t.tool_prompts)),
            ("calls valid", lambda t: pct(t.calls_valid, t.calls)),
            ("text answers (no tool fits)", lambda t: pct(t.text_answers, t.text_prompts)),
            ("calls left in text (unparsed)", lambda t: str(t.calls_in_text)),
            ("errors", lambda t: str(t.errors))]
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(t) for t in tallies) + " |")


async def bench(args: argparse.Namespace) -> tuple[list[str], list[Tally]]:
    import aiohttp

    names = args.name + [f"server{i + 1}" for i in range(len(args.name), len(args.url))]
    keys = args.api_key + [""] * (len(args.url) - len(args.api_key))
    prompts = chosen_prompts(args.limit)
    tallies = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for url, name, key in zip(args.url, names, keys):  # one server at a time: each has the machine
            tally = await run_server(session, url, key or None, args, prompts)
            print(f"  {name}: {tally.calls_made}/{tally.tool_prompts} calls made, {tally.calls_valid}/{tally.calls} valid, "
                  f"{tally.text_answers}/{tally.text_prompts} text answers, {tally.calls_in_text} calls left in text, "
                  f"{tally.errors} errors", flush=True)
            tallies.append(tally)
    return names, tallies


def run(args: argparse.Namespace) -> int:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise SystemExit("bench tools validates calls with jsonschema: pip install jsonschema") from None
    names, tallies = asyncio.run(bench(args))
    print_table(names, tallies)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {**t.row(), "answers": t.answers} for n, t in zip(names, tallies)}, f, indent=2)
    return 0
