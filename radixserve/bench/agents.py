"""`radixserve bench agents --url URL`: agent programs against a running server, over HTTP.

Two programs, each written twice and run in the same process run:

- in frontend_lang (`frontend_lang` over the native API): the expert panel forks its experts
  off the shared briefing and sends them together; the ReAct loop picks its tool with `select`
  and continues one growing prompt;
- as plain sequential calls with the official `openai` client (chat completions, structured
  outputs for the JSON): one call after another, each re-sending its messages.

Programs: `panel` (a long shared briefing, N experts, a judge's JSON verdict) and `react`
(tool choice, JSON arguments, a real tool, an observation, a final answer). Each point of a
concurrency sweep runs a number of programs with that many in flight, from a flushed cache,
and reports programs/s and the prompt tokens the server served from its cache (read from
/server_info before and after). Every expert and answer generates a fixed number of tokens
(ignore_eos), so both versions do the same decode work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from radixserve.bench import bearer

BRIEFING_PART = (
    "You sit on a panel that reviews a small city's transport plan. The plan proposes three options: "
    "(A) a tram line along the river, (B) twice as many buses on the existing routes, and (C) protected "
    "bike lanes on the four main avenues. The budget covers one option. Judge each option on cost, on "
    "time to build, on how many residents it serves, and on its effect on traffic and emissions. "
)
TOPICS = ["Which option should the city fund?", "Which option helps commuters most?", "Which option is cheapest to run?",
          "Which option cuts emissions fastest?", "Which option serves the old town best?", "Which option is safest?",
          "Which option is quickest to build?", "Which option is most popular?"]
VERDICT = {"type": "object", "properties": {"choice": {"enum": ["A", "B", "C"]}, "reason": {"type": "string", "maxLength": 40}},
           "required": ["choice", "reason"], "additionalProperties": False}

FACTS = {"tram": "The tram line costs 240 million and takes 5 years.", "buses": "More buses cost 30 million a year.",
         "bikes": "The bike lanes cost 18 million and take 1 year."}
TOOLS = ["calculator", "lookup"]
REACT_SYSTEM = ("You are an analyst with two tools. calculator: evaluates arithmetic, e.g. {\"expression\": \"240 / 5\"}. "
                "lookup: returns the fact sheet of one option, e.g. {\"topic\": \"tram\"}. Use a tool at each step, "
                "then answer in one sentence. " + " ".join(FACTS.values()))
QUESTIONS = ["What does the tram cost per year of building?", "How much do buses cost over 4 years?",
             "What do the bike lanes cost per month of building?", "Which option is cheapest over 5 years?"]
ARGS = {"calculator": {"type": "object", "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,20}$"}},
                       "required": ["expression"], "additionalProperties": False},
        "lookup": {"type": "object", "properties": {"topic": {"enum": list(FACTS)}},
                   "required": ["topic"], "additionalProperties": False}}
STEP = {"type": "object", "properties": {"action": {"enum": TOOLS}, "argument": {"type": "string", "maxLength": 20}},
        "required": ["action", "argument"], "additionalProperties": False}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None, help="needs an admin tenant: each point starts from a flushed cache")
    p.add_argument("--programs", default="panel,react", help="comma-separated: panel, react")
    p.add_argument("--concurrency", default="1,4,8", help="programs in flight, a sweep")
    p.add_argument("--runs", type=int, default=8, help="programs per point")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--briefing-repeats", type=int, default=10, help="length of the panel's shared briefing (~80 tokens each)")
    p.add_argument("--steps", type=int, default=2, help="ReAct tool steps before the answer")
    p.add_argument("--output-len", type=int, default=32, help="tokens per expert opinion and per final answer")
    p.add_argument("--json", default=None, help="write every point to this file")


def run_tool(action: str, arg: str) -> str:
    """The real tools: arithmetic on a whitelisted alphabet, and the fact sheets."""
    if action == "calculator":
        if not re.fullmatch(r"[0-9+*/() .-]{1,20}", arg):
            return "error: not arithmetic"
        try:
            return str(eval(arg, {"__builtins__": {}}, {}))  # noqa: S307 - digits and operators only, checked above
        except (SyntaxError, ZeroDivisionError, TypeError, ValueError) as e:
            return f"error: {e}"
    return FACTS.get(arg.strip().lower(), f"error: no fact sheet for {arg!r}")


# -- frontend_lang --------------------------------------------------------------------------------
def dsl_programs() -> dict[str, Any]:
    import frontend_lang as sgl

    @sgl.function
    def panel(s, briefing: str, topic: str, experts: int, tokens: int):
        s += sgl.system(briefing)
        s += sgl.user(topic)
        forks = s.fork(experts)
        forks += lambda i: sgl.assistant(f"Expert {i + 1}: " + sgl.gen("opinion", max_tokens=tokens, ignore_eos=True,
                                                                        temperature=0.7))
        forks.join()
        said = "\n".join(f"Expert {i + 1}: {o.strip()}" for i, o in enumerate(s["opinion"]))
        s += sgl.user(f"The experts said:\n{said}\nAs the judge, give the verdict as JSON.")
        s += sgl.assistant(sgl.gen("verdict", json_schema=VERDICT, max_tokens=128))
        json.loads(s["verdict"])

    @sgl.function
    def react(s, question: str, steps: int, tokens: int):
        s += sgl.system(REACT_SYSTEM)
        s += sgl.user(question)
        for i in range(steps):
            with s.assistant():
                s += "Action: " + sgl.select(f"action_{i}", TOOLS) + "\nArguments: "
                action = s[f"action_{i}"]  # waits for the select
                s += sgl.gen(f"args_{i}", json_schema=ARGS[action], max_tokens=48)
            args = json.loads(s[f"args_{i}"])
            s += sgl.user("Observation: " + run_tool(action, next(iter(args.values()))))
        s += sgl.assistant("Answer: " + sgl.gen("answer", max_tokens=tokens, ignore_eos=True))

    return {"panel": panel, "react": react}


def run_dsl(url: str, api_key: str | None, program: str, kwargs: list[dict[str, Any]], concurrency: int) -> int:
    import frontend_lang as sgl

    func = dsl_programs()[program]
    ep = sgl.RuntimeEndpoint(url, api_key=api_key)
    states = func.run_batch(kwargs, backend=ep, num_threads=concurrency)
    return len(states)


# -- the official openai client, plain sequential calls ---------------------------------------------
async def panel_openai(client: Any, model: str, briefing: str, topic: str, experts: int, tokens: int) -> None:
    base = [{"role": "system", "content": briefing}, {"role": "user", "content": topic}]
    opinions = []
    for i in range(experts):
        r = await client.chat.completions.create(
            model=model, messages=[*base, {"role": "user", "content": f"Answer as expert {i + 1}."}], max_tokens=tokens,
            temperature=0.7, extra_body={"ignore_eos": True})
        opinions.append(r.choices[0].message.content or "")
    said = "\n".join(f"Expert {i + 1}: {o.strip()}" for i, o in enumerate(opinions))
    judge = {"role": "user", "content": f"The experts said:\n{said}\nAs the judge, give the verdict as JSON."}
    r = await client.chat.completions.create(model=model, messages=[*base, judge], max_tokens=128, temperature=0.0,
                                             response_format=_schema("verdict", VERDICT))
    json.loads(r.choices[0].message.content)


async def react_openai(client: Any, model: str, question: str, steps: int, tokens: int) -> None:
    messages = [{"role": "system", "content": REACT_SYSTEM}, {"role": "user", "content": question}]
    for _ in range(steps):
        r = await client.chat.completions.create(model=model, messages=messages, max_tokens=128, temperature=0.0,
                                                 response_format=_schema("step", STEP))
        step = json.loads(r.choices[0].message.content)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Observation: " + run_tool(step["action"], step["argument"])}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0.0,
                                         extra_body={"ignore_eos": True})


def _schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def run_openai(url: str, api_key: str | None, program: str, kwargs: list[dict[str, Any]], concurrency: int) -> int:
    try:
        from openai import AsyncOpenAI
    except ImportError:
        raise ValueError("bench agents: the baseline needs the openai package (pip install openai)") from None
    programs: dict[str, Callable[..., Awaitable[None]]] = {"panel": panel_openai, "react": react_openai}
    fn = programs[program]
    for name in ("httpx", "httpx2"):  # one INFO line per call otherwise
        logging.getLogger(name).setLevel(logging.WARNING)

    async def main() -> int:
        async with AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            gate = asyncio.Semaphore(concurrency)

            async def one(kw: dict[str, Any]) -> None:
                async with gate:
                    await fn(client, model, **kw)

            await asyncio.gather(*(one(kw) for kw in kwargs))
        return len(kwargs)

    return asyncio.run(main())


# -- the sweep ------------------------------------------------------------------------------------
def _http(url: str, path: str, api_key: str | None, body: Any = None) -> Any:
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **bearer(api_key)})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def program_kwargs(program: str, n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    if program == "panel":
        briefing = BRIEFING_PART * args.briefing_repeats
        return [{"briefing": briefing, "topic": TOPICS[i % len(TOPICS)], "experts": args.experts, "tokens": args.output_len}
                for i in range(n)]
    return [{"question": QUESTIONS[i % len(QUESTIONS)], "steps": args.steps, "tokens": args.output_len} for i in range(n)]


def point(args: argparse.Namespace, system: str, program: str, concurrency: int) -> dict[str, Any]:
    _http(args.url, "/flush_cache", args.api_key, {})
    before = _http(args.url, "/server_info", args.api_key)["kv"]
    runner = run_dsl if system == "frontend_lang" else run_openai
    t0 = time.perf_counter()
    done = runner(args.url, args.api_key, program, program_kwargs(program, args.runs, args), concurrency)
    wall = time.perf_counter() - t0
    after = _http(args.url, "/server_info", args.api_key)["kv"]
    delta = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_prompt_tokens", "prefill_tokens_computed",
                                               "decode_tokens")}
    return {"system": system, "program": program, "concurrency": concurrency, "programs": done, "wall_s": wall,
            "programs_per_s": done / wall, **delta,
            "cached_share": delta["cached_prompt_tokens"] / delta["prompt_tokens"] if delta.get("prompt_tokens") else 0.0}


def run(args: argparse.Namespace) -> int:
    programs = [p for p in args.programs.split(",") if p]
    unknown = set(programs) - {"panel", "react"}
    if unknown:
        raise ValueError(f"programs: unknown {', '.join(sorted(unknown))} (panel, react)")
    sweep = [int(c) for c in args.concurrency.split(",") if c]
    points = []
    print(f"{'program':<8}{'system':<15}{'conc':>5}{'programs/s':>12}{'prompt tok':>12}{'from cache':>12}{'computed':>10}"
          f"{'speed-up':>10}")
    for program in programs:
        for c in sweep:
            pair = {system: point(args, system, program, c) for system in ("frontend_lang", "openai_sequential")}
            ratio = pair["frontend_lang"]["programs_per_s"] / pair["openai_sequential"]["programs_per_s"]
            for system, p in pair.items():
                p["speedup_vs_openai_sequential"] = ratio if system == "frontend_lang" else 1.0
                points.append(p)
                print(f"{program:<8}{system:<15}{c:>5}{p['programs_per_s']:>12.3f}{p['prompt_tokens']:>12,}"
                      f"{p['cached_prompt_tokens']:>12,}{p['prefill_tokens_computed']:>10,}"
                      f"{p['speedup_vs_openai_sequential']:>9.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "points": points}, f, indent=1)
    return 0
