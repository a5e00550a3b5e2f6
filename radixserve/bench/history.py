"""`radixserve bench history`: a reasoning agent's session, turn by turn, with the history
precompute on and off (`--precompute-history`, server/chat/history.py).

Each run starts its own `radixserve serve` with a chat template that drops an earlier answer's
reasoning, as Qwen3's does (the built-in one below, Qwen3's ChatML shape, unless
--chat-template names another), then plays --turns turns of one conversation over the chat
API, streamed: a long system prompt (an agent manual, ~--system-tokens), a short question per
turn, and answers that think first: a regex holds each answer to `<think>\\n…\\n</think>\\n\\n…`
(the model writes the text; the client sends each answer back whole, reasoning and all, and the
template drops the reasoning, as Qwen3's does). Between turns the client waits for the server's
precompute (as an agent runs its tools). Printed per turn, on and off: prompt tokens, cached
tokens, tokens computed and time to first token; the goal is that every returning turn with
the precompute on has at least 95 % of its prompt cached (it computes only its new message);
the answers must be the same on and off (greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from typing import Any

from radixserve.bench.prefix import documentation
from radixserve.bench.sessions import Server, stream_chat

QWEN3_SHAPED = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') if '</think>' in m.content else m.content %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
THINKING = "<think>\\n[A-Za-z ,.]{{{lo},{hi}}}\\n</think>\\n\\n[A-Za-z ,.]{{20,160}}"
CHARS_PER_TOKEN = 4.6
QUESTIONS = ["Which tool lists the files?", "And which one reads a file?", "How do I search the text?",
             "What does the manual say about errors?", "Which step comes last?", "Summarize the plan.",
             "What should I check first?", "Which tool writes a file?"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--chat-template", default=None, help="a template that drops earlier reasoning (default: a Qwen3-shaped "
                                                         "ChatML one)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1500, help="the system prompt's size, about")
    p.add_argument("--think-chars", type=int, default=400, help="each answer's reasoning, in characters (at least half of it)")
    p.add_argument("--port", type=int, default=30124)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for `radixserve serve` (repeat)")


async def _turn(session: Any, url: str, messages: list[dict[str, Any]], regex: str) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first content, the whole answer, usage), streamed."""
    body = {"messages": messages, "max_tokens": 512, "temperature": 0.0, "regex": regex}
    return await stream_chat(session, url, body, "history")


async def _settled(session: Any, url: str) -> dict[str, Any]:
    """The server's history counters once no precompute runs (an agent's tools take longer)."""
    while True:
        async with session.get(url + "/server_info") as r:
            history = dict((await r.json())["history"])
        if not history["running"]:
            return history
        await asyncio.sleep(0.02)


async def _session(args: argparse.Namespace, template: str, precompute: bool) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(args.seed)
    system = "You are an agent with tools. Read the manual below before you act.\n\n"
    while len(system) < args.system_tokens * CHARS_PER_TOKEN:
        system += documentation(rng, 10)
    regex = THINKING.format(lo=args.think_chars // 2, hi=args.think_chars)
    flag = "--precompute-history" if precompute else "--no-precompute-history"
    server = Server(args, ["--chat-template", template, flag], "history")
    turns = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await server.ready(session)
            await _turn(session, server.url, [{"role": "user", "content": documentation(rng, 60)}], regex)  # first-call costs
            messages = [{"role": "system", "content": system}]
            for k in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
                ttft, answer, usage = await _turn(session, server.url, messages, regex)
                messages.append({"role": "assistant", "content": answer})
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                turns.append({"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                              "computed_tokens": usage["prompt_tokens"] - cached, "ttft_s": ttft, "answer": answer})
                history = await _settled(session, server.url)
    finally:
        server.stop()
    return {"turns": turns, "history": history}


def run(args: argparse.Namespace) -> int:
    template = args.chat_template or QWEN3_SHAPED
    runs = {}
    for name, on in (("on", True), ("off", False)):
        runs[name] = asyncio.run(_session(args, template, on))
    on, off = runs["on"]["turns"], runs["off"]["turns"]
    print(f"{'turn':>4} | {'prompt':>6} | {'on: cached':>10} {'computed':>8} {'share':>6} {'TTFT ms':>8} | "
          f"{'off: cached':>11} {'computed':>8} {'share':>6} {'TTFT ms':>8}")
    for k, (a, b) in enumerate(zip(on, off)):
        print(f"{k + 1:>4} | {a['prompt_tokens']:>6} | {a['cached_tokens']:>10} {a['computed_tokens']:>8} "
              f"{a['cached_tokens'] / a['prompt_tokens']:>6.1%} {a['ttft_s'] * 1e3:>8.1f} | {b['cached_tokens']:>11} "
              f"{b['computed_tokens']:>8} {b['cached_tokens'] / b['prompt_tokens']:>6.1%} {b['ttft_s'] * 1e3:>8.1f}")
    returning = on[1:]
    worst = min((t["cached_tokens"] / t["prompt_tokens"] for t in returning), default=1.0)
    same = [t["answer"] for t in on] == [t["answer"] for t in off]
    print(f"returning turns, precompute on: at least {worst:.1%} of each prompt cached (goal >= 95%: "
          f"{'met' if worst >= 0.95 else 'missed'}); answers the same on and off: {same}")
    print(f"precompute counters: {runs['on']['history']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "func"}, **runs, "worst_returning_share": worst,
                       "answers_same": same}, f, indent=1)
    return 0 if same else 1
